"""Greedy held-out evaluation through the sampler engine: EM and F1, overall, by hops, by source."""

from __future__ import annotations

import collections
import contextlib
import dataclasses

import numpy as np

from trace_jax.envs.checks import check_examples
from trace_jax.envs.react import parse_action
from trace_jax.envs.scoring import exact_match, f1
from trace_jax.sampling.engine import PromptRequest, SamplerEngine


@contextlib.contextmanager
def sampling_mode(engine: SamplerEngine, **overrides):
  """Temporarily changes per-call sampling settings (greedy, temperature, ...) of an engine."""
  old = engine.cfg
  engine.cfg = dataclasses.replace(old, **overrides)
  try:
    yield engine
  finally:
    engine.cfg = old


def final_answer(tree) -> str | None:
  leaves = tree.leaves()
  if not leaves:
    return None
  a = parse_action(leaves[0].text)
  return a.content if a.kind == "answer" else None


def evaluate(engine: SamplerEngine, examples: list[dict], batch: int = 256,
             keep_trees: bool = False, reward_is_em: bool = False) -> dict:
  """examples: dicts with prompt_ids, answers (EM: exact match of the final answer, or with
  `reward_is_em` the rollout's reward above one half: tasks whose environment checks more than
  an answer string), and optional hops / source / entity_seen (the
  synthetic world's: the question's entity appears in a train question) / groups (labels an
  example counts under, e.g. the lessons world's relations). Greedy, one rollout each.

  Returns em, f1, n, em_by_hops, em_by_source, f1_by_source, em_by_seen ({"seen", "unseen"}:
  EM of each half, when the examples say), em_by_group (each label: EM over the examples that
  carry it), mean_turns, generated_tokens; with `keep_trees`,
  also `trees` (one per example, their pages released: for inspecting why rollouts fail).
  An example without them raises ValueError naming it (`envs.checks.check_examples`) before any
  sampling.
  """
  check_examples(examples, None, "evaluation")
  ems, f1s, turns, kept = [], [], [], []
  by_hops, by_src, f1_src, by_seen, by_group = (collections.defaultdict(list) for _ in range(5))
  led0 = engine.ledger.generated_tokens
  with sampling_mode(engine, greedy=True):
    for i in range(0, len(examples), batch):
      chunk = examples[i:i + batch]
      trees = engine.run([PromptRequest(e["prompt_ids"], 1, meta=e) for e in chunk])
      for e, t in zip(chunk, trees):
        pred = final_answer(t)
        em = (float((t.leaves()[0].reward or 0.0) > 0.5) if reward_is_em and t.leaves()
              else exact_match(pred, e["answers"]))
        f = f1(pred, e["answers"])
        ems.append(em)
        f1s.append(f)
        turns.append(max(n.depth for n in t.nodes))
        if e.get("hops") is not None:
          by_hops[int(e["hops"])].append(em)
        if e.get("entity_seen") is not None:
          by_seen["seen" if e["entity_seen"] else "unseen"].append(em)
        for g in e.get("groups") or ():
          by_group[g].append(em)
        src = e.get("source", "default")
        by_src[src].append(em)
        f1_src[src].append(f)
      engine.release(trees)
      if keep_trees:
        kept += trees
  mean = lambda v: float(np.mean(v)) if v else float("nan")  # noqa: E731
  return dict(em=mean(ems), f1=mean(f1s), n=len(ems), mean_turns=mean(turns),
              em_by_hops={h: mean(v) for h, v in sorted(by_hops.items())},
              em_by_source={s: mean(v) for s, v in sorted(by_src.items())},
              f1_by_source={s: mean(v) for s, v in sorted(f1_src.items())},
              em_by_seen={k: mean(v) for k, v in sorted(by_seen.items())},
              em_by_group={k: mean(v) for k, v in sorted(by_group.items())},
              generated_tokens=engine.ledger.generated_tokens - led0,
              **({"trees": kept} if keep_trees else {}))
