"""Scripted, imperfect expert traces for the synthetic world, and the SFT dataset built from them.

The expert plans the question's chain hop by hop, searches with real BM25 (the world's retriever,
top-k as in the environment), reads the first sentence in rank order that states the relation it
wants, and follows the entity named there, right or wrong. Its mistakes:

  * systematic: on trap relations it copies the question's wording ("founder of Zantro") with
    probability `trap_rate`; that query surfaces a misleading passage, and the expert then
    follows the wrong candidate to a wrong answer. The passage wording ("founded Zantro") is
    in the traces too, but rarer;
  * random: a near-duplicate or wrong entity in a query, a skipped intermediate hop, a premature
    answer.

Traces are exactly what `MultiHopEnv` would return for the same action texts, so they can be
replayed in the environment.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Optional, Sequence

import numpy as np

from trace_jax.envs import prompts
from trace_jax.envs.react import format_observation
from trace_jax.envs.scoring import exact_match
from trace_jax.envs.worlds.synthetic_schema import CITY_COUNTRY_ALTERNATIVES, RELATIONS
from trace_jax.envs.worlds.synthetic_world import SyntheticQuestion, World
from trace_jax.envs.types import Doc

_NAME = r"([A-Z][A-Za-z]*)"


@dataclasses.dataclass
class Trace:
  """turns: [(generated_text, observation_text or None for the final answer turn)].

  meta: `searches` (one dict per search: relation, subject, query, wording, needed_doc_id, hit),
  `errors` (random mistakes injected), `misled` (followed a misleading sentence).
  """

  turns: list
  answer: str
  correct: bool
  meta: dict


@dataclasses.dataclass
class SFTRecord:
  example: SyntheticQuestion
  trace: Trace

  def segments(self) -> list[tuple[str, bool]]:
    """[(text, is_generated)]: the prompt, then the turns; observations are not trained on."""
    return trace_segments(self.example, self.trace)


@functools.lru_cache(maxsize=1 << 16)  # Compiling dominates trace generation otherwise.
def _pattern(template: str, subject: str) -> re.Pattern:
  rx = re.escape(template).replace(r"\{s\}", re.escape(subject))
  rx = rx.replace(r"\{o\}", _NAME).replace(r"\{w\}", _NAME)
  return re.compile(rf"(?<![A-Za-z]){rx}")


def read_fact(docs: Sequence[Doc], relation: str, subject: str,
              schema: Optional[dict] = None) -> tuple[Optional[str], str, bool]:
  """The expert's reading: the first sentence, in rank order, that states `relation(subject)`
  (`schema`: the world's relations, default the embedded world's).

  Returns (object or None, the sentence without its final period, whether it was misleading).
  """
  rel = (RELATIONS if schema is None else schema)[relation]
  templates = [(rel.fact, False)]
  if relation == "city_country":
    templates.extend((t, False) for t in CITY_COUNTRY_ALTERNATIVES)
  if rel.misleading:
    templates.append((rel.misleading, True))
  templates.extend((m, True) for _, m in rel.decoys)
  patterns = [(_pattern(t, subject), misleading) for t, misleading in templates]
  for doc in docs:
    best = None
    for pat, misleading in patterns:
      m = pat.search(doc.text)
      if m and (best is None or m.start() < best[0].start()):
        best = (m, misleading)
    if best is not None:
      m, misleading = best
      return m.group(1), m.group(0).rstrip(" ."), misleading
  return None, "", False


def _guess_name(docs: Sequence[Doc], exclude: str) -> Optional[str]:
  for doc in docs:
    for name in re.findall(r"\b[A-Z][a-z]+\b", doc.text):
      if name != exclude:
        return name
  return None


def _wrong_entity(world: World, name: str, rng: np.random.Generator) -> str:
  if name in world.twins:
    return world.twins[name]
  etype = world.entities[name]
  same = [n for n in world.entities if world.entities[n] == etype and n != name]
  return same[int(rng.integers(len(same)))]


def expert_trace(world: World, example: SyntheticQuestion, rng: np.random.Generator) -> Trace:
  """One imperfect expert rollout for `example` (see the module docstring for its mistakes)."""
  cfg = world.config
  plan = list(example.meta["relations"])
  errors = []
  if len(plan) >= 2 and rng.random() < cfg.skip_hop_rate:
    del plan[int(rng.integers(len(plan) - 1))]
    errors.append("skip_hop")
  stop_after = len(plan)
  if len(plan) >= 2 and rng.random() < cfg.premature_guess_rate:
    stop_after = int(rng.integers(1, len(plan)))
    errors.append("premature_guess")
  plan = plan[:min(stop_after, cfg.max_turns - 1)]

  current, statement = example.meta["start"], ""
  turns, searches, misled = [], [], False
  for relation in plan:
    rel = world.relations[relation]
    subject = current
    wording = "passage"
    if rng.random() < cfg.wrong_entity_rate:
      subject = _wrong_entity(world, current, rng)
      errors.append("wrong_entity")
    query = rel.query_passage.format(x=subject)
    if rel.decoys:  # a lesson: the matching wording at the relation's own rate, else a decoy
      if rng.random() >= world.lessons[relation]["expert_rate"]:
        j = int(rng.integers(len(rel.decoys)))
        wording, query = f"decoy{j}", rel.decoys[j][0].format(x=subject)
    # A trap relation: the question's wording at trap_rate. Elsewhere both wordings work; both
    # are used, so wording alone is not a tell. (A lessons world's plain relations, with
    # passages that have no title, answer their verb only.)
    elif not world.lessons and rng.random() < (
        cfg.trap_rate if relation in cfg.trap_relations else 0.5):
      wording, query = "question", rel.question_query(subject)
    need = f"need {rel.noun} of {current}"
    think = f"{statement} . {need}" if statement else need
    docs = world.search([query])[0]
    turns.append((f"<think> {think} </think> <search> {query} </search>", format_observation(docs)))
    needed = world.needed_doc_id(relation, subject) if subject in world.facts[relation] else None
    searches.append({
        "relation": relation, "subject": subject, "query": query, "wording": wording,
        "needed_doc_id": needed, "hit": needed is not None and any(d.id == needed for d in docs),
    })
    found, statement, was_misleading = read_fact(docs, relation, subject, world.relations)
    misled |= was_misleading
    if found is None:
      found = _guess_name(docs, exclude=subject) or subject
      statement = f"no {rel.noun} of {subject} found"
    current = found
  think = statement or f"the answer is {current}"
  turns.append((f"<think> {think} </think> <answer> {current} </answer>", None))
  correct = bool(exact_match(current, example.answers))
  return Trace(turns=turns, answer=current, correct=correct,
               meta={"searches": searches, "errors": errors, "misled": misled})


def oracle_world(world: World) -> World:
  """`world` with a flawless expert: no random mistakes, the passage wording on every trap
  relation and the fact verb on every lesson. Its traces answer every question whose fact
  searches succeed (the lessons world keeps only such questions)."""
  cfg = dataclasses.replace(world.config, wrong_entity_rate=0.0, skip_hop_rate=0.0,
                            premature_guess_rate=0.0, trap_rate=0.0)
  lessons = {r: dict(v, expert_rate=1.0) for r, v in world.lessons.items()}
  return dataclasses.replace(world, config=cfg, lessons=lessons)


def trace_segments(example: SyntheticQuestion, trace: Trace) -> list[tuple[str, bool]]:
  """[(text, is_generated)] for the synthetic prompt followed by the trace's turns."""
  segments = [(prompts.synthetic_prompt(example.question), False)]
  for generated, observation in trace.turns:
    segments.append((generated, True))
    if observation is not None:
      segments.append((observation, False))
  return segments


def make_sft_dataset(
    world: World, n: int, rng: np.random.Generator, split: str = "train",
    examples: Optional[Sequence[SyntheticQuestion]] = None,
) -> list[SFTRecord]:
  """`n` expert traces on questions drawn uniformly (with replacement) from `split`, or from
  `examples` when given (e.g. to keep the RL prompts out of fine-tuning).

  Failed traces are kept on purpose: the expert does not know it failed, and dropping them would
  remove the systematic mistake the RL stage is meant to discover.
  """
  if examples is None:
    if split not in ("train", "test"):
      raise ValueError(f"world has no {split!r} examples; split is 'train' or 'test'")
    examples = getattr(world, split)
  if not examples:
    raise ValueError(f"no examples to draw from (split {split!r})")
  idx = rng.integers(len(examples), size=n)
  return [SFTRecord(examples[i], expert_trace(world, examples[i], rng)) for i in idx]
