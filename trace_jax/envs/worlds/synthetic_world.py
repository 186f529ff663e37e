"""A seeded synthetic multi-hop world: entities, typed facts, one passage each, chained questions.

Difficulty is built in, not sprinkled on (DESIGN.md §3):
  * near-duplicate names (one letter apart) of the same type, so copying a name must be exact;
  * distractor sentences in every passage mention other entities;
  * two relations are "traps". Their fact is stated only in the *object's* passage ("Kelmor
    founded Zantro ."), where the subject's name appears once, so the query's wording decides the
    ranking. The wording a question suggests ("founder of Zantro") matches a planted misleading
    sentence in a wrong candidate's passage ("Kelmar is called the founder of Zantro ."), which
    then fills the top-k; the passage wording ("founded Zantro") finds the true fact. The expert
    mostly uses the question's wording, so the better query exists in the traces but is rare,
    and following the misleading passage leads to a wrong answer.

The schema (relations, wordings, templates) lives in `synthetic_schema`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Optional, Sequence

import numpy as np

from trace_jax.envs.retrieval.bm25 import BM25Retriever
from trace_jax.envs.worlds.synthetic_schema import (  # noqa: F401  (some names re-exported)
    CITY_COUNTRY_ALTERNATIVES, DISTRACTOR_TEMPLATES, ENTITY_TYPES, FORBIDDEN_RELATION_PAIRS,
    NAME_CODAS, NAME_ONSETS, NAME_VOWELS, NEXT_RELATIONS_BY_TYPE, RELATIONS, RESERVED_NAMES,
    TYPE_INTROS, Relation,
)
from trace_jax.envs.types import Doc
from trace_jax.fileio import CorruptFileError, atomic_write_json, read_json


@dataclasses.dataclass
class SyntheticWorldConfig:
  """Everything that shapes a world; the seed makes it reproducible."""

  seed: int = 0
  n_entities: int = 2000
  # Order of ENTITY_TYPES. Enough persons without a company to carry the misleading founder
  # sentences one each, which keeps passages (and observations) short.
  type_fractions: tuple = (0.05, 0.25, 0.45, 0.12, 0.13)
  near_duplicate_rate: float = 0.2  # Share of entities that are a one-letter twin of another.
  works_for_rate: float = 0.5  # Persons with an employer; the others studied at a university.
  distractors_per_passage: int = 1
  max_passage_words: int = 24  # Distractors are only added while a passage stays this short.
  n_train: int = 4000  # Questions; start entities are disjoint between splits.
  n_test: int = 500
  test_start_fraction: float = 0.2  # Share of entities that start only test questions.
  # If True, no fact used by a test chain is used by any train chain, so test accuracy cannot
  # come from facts memorized during fine-tuning, only from retrieval.
  holdout_test_facts: bool = False
  hop_weights: tuple = (0.25, 0.3, 0.25, 0.2)  # P(1 hop), ..., P(4 hops).
  topk: int = 2  # Passages per search (observations stay under ~64 tokens).
  # BM25 parameters of world.retriever(). A low b: passages are all short, and length
  # normalization would otherwise decide between passages that match the same terms.
  bm25_k1: float = 1.5
  bm25_b: float = 0.3
  max_turns: int = 5
  trap_relations: tuple = ("founded_by", "capital")
  # Expert behaviour.
  trap_rate: float = 0.7  # P(question wording) on a trap relation: the systematic mistake.
  wrong_entity_rate: float = 0.04  # Per search: query names a near-duplicate or wrong entity.
  skip_hop_rate: float = 0.05  # Per question of >= 2 hops: one intermediate hop is skipped.
  premature_guess_rate: float = 0.05  # Per question of >= 2 hops: answers before the end.


@dataclasses.dataclass
class LessonsWorldConfig:
  """Everything that shapes a lessons world (`lessons_world`); the seed makes it reproducible."""

  kind: str = "lessons"
  seed: int = 0
  n_entities: int = 1200
  n_relations: int = 32  # K lessons (at most len(NOUNS) - n_plain_relations)
  n_wordings: int = 2  # W query verbs per relation: one fact verb, W - 1 decoys
  # Relations with one verb and no decoy: nothing to learn. With `one_lesson_per_question`
  # every hop but one is plain, so a question holds exactly one lesson.
  n_plain_relations: int = 4
  one_lesson_per_question: bool = True
  zipf_exponent: float = 1.0  # lesson weights 1 / rank^s, ranks in a seeded random order
  # The expert's rate of the fact verb per lesson: evenly spaced over this range ("linear") or
  # over its logarithm ("log"), assigned to lessons in a random order independent of frequency
  # (the other W - 1 verbs share the rest). projects/lessons/README.md says why these values
  # (world versions v1-v3 used linear spacing over (0.05, 0.8), (0.05, 0.9), (0.15, 0.95), a
  # lesson at every hop and zipf 0.8).
  expert_rate_range: tuple = (0.003, 0.9)
  expert_rate_spacing: str = "log"
  out_degree: tuple = (1, 2, 3)  # lesson relations an entity is the subject of, drawn evenly
  hop_weights: tuple = (0.0, 0.7, 0.2, 0.1)  # P(1 hop), ..., P(4 hops)
  n_train: int = 4000
  n_test: int = 512
  # Held-out questions spread evenly over the lessons (n_test / K each), so held-out EM counts
  # lessons learned, not mostly the frequent ones; training keeps the long tail.
  balanced_test: bool = True
  near_duplicate_rate: float = 0.02  # share of names that are a one-letter twin of another
  topk: int = 2
  bm25_k1: float = 1.5
  bm25_b: float = 0.3
  max_turns: int = 5
  # Expert behaviour beyond the lessons (as in the embedded world, smaller).
  wrong_entity_rate: float = 0.02
  skip_hop_rate: float = 0.02
  premature_guess_rate: float = 0.02
  # The embedded world's trap fields, kept for the expert's shared code: no trap relations here.
  trap_relations: tuple = ()
  trap_rate: float = 0.0


@dataclasses.dataclass(frozen=True)
class SyntheticQuestion:
  """One question, shaped like `data.formats.QAExample` where it matters (id, question,
  answers). meta: start, relations, chain (start then the entity after each hop),
  needed_doc_ids (the passage stating each hop's fact), split."""

  id: str
  question: str
  answers: list
  hops: int
  meta: dict


QAExample = SyntheticQuestion  # The name the first version used.


_FORMAT_VERSION = 1


@dataclasses.dataclass
class World:
  """A generated world. Passage ids are entity names; `retriever()` is BM25 over `corpus` with
  the config's parameters, built once; `search` adds a query cache for trace generation."""

  config: SyntheticWorldConfig
  entities: dict  # name -> type
  facts: dict  # relation -> {subject: object}
  corpus: list  # list[Doc], doc id == entity name
  train: list  # list[SyntheticQuestion]
  test: list
  twins: dict  # name -> near-duplicate name (both directions)
  traps: dict  # "relation|subject" -> wrong candidates planted for it
  # The schema of this world's relations (the embedded world's `RELATIONS` unless the world
  # brings its own: `lessons_world`), and per-relation facts of a lessons world.
  relations: dict = dataclasses.field(default_factory=lambda: dict(RELATIONS))
  lessons: dict = dataclasses.field(default_factory=dict)
  generation: dict = dataclasses.field(default_factory=dict)  # what generation dropped, counted
  _retriever: Optional[BM25Retriever] = dataclasses.field(default=None, repr=False)
  _cache: dict = dataclasses.field(default_factory=dict, repr=False)

  def retriever(self) -> BM25Retriever:
    r, cfg = self._retriever, self.config
    if r is None or (r.k1, r.b) != (cfg.bm25_k1, cfg.bm25_b):  # Config replaced since built.
      self._retriever = BM25Retriever.from_docs(self.corpus, k1=cfg.bm25_k1, b=cfg.bm25_b)
      self._cache = {}
    return self._retriever

  def search(self, queries: Sequence[str], k: Optional[int] = None) -> list[list[Doc]]:
    """Cached batched search (queries repeat a lot across expert traces)."""
    k = self.config.topk if k is None else k
    retriever = self.retriever()
    missing = [q for q in dict.fromkeys(queries) if (q, k) not in self._cache]
    if missing:
      for q, docs in zip(missing, retriever.search(missing, k)):
        self._cache[(q, k)] = docs
    return [self._cache[(q, k)] for q in queries]

  def needed_doc_id(self, relation: str, subject: str) -> str:
    """Id of the passage that states the true fact `relation(subject)`."""
    if self.lessons:  # a passage per sentence (`lessons_world.fact_doc_id`)
      return f"{relation}:{subject}"
    rel = self.relations[relation]
    return self.facts[relation][subject] if rel.on_object_side else subject

  def save(self, directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    payload = {
        "format_version": _FORMAT_VERSION,
        "config": dataclasses.asdict(self.config),
        "entities": self.entities,
        "facts": self.facts,
        "corpus": [dataclasses.asdict(d) for d in self.corpus],
        "train": [dataclasses.asdict(e) for e in self.train],
        "test": [dataclasses.asdict(e) for e in self.test],
        "twins": self.twins,
        "traps": self.traps,
    }
    if self.lessons:  # a world with its own schema (the embedded one is `RELATIONS`)
      payload["relations"] = {k: dataclasses.asdict(r) for k, r in self.relations.items()}
      payload["lessons"] = self.lessons
      payload["generation"] = self.generation
    # Atomic: a run killed mid-write leaves no torn world.json for the next run to take as done.
    atomic_write_json(os.path.join(directory, "world.json"), payload)

  @classmethod
  def load(cls, directory: str) -> "World":
    path = os.path.join(directory, "world.json")
    if not os.path.exists(path):
      raise FileNotFoundError(f"{path} not found: not a directory written by World.save")
    p = read_json(path)  # CorruptFileError (a ValueError) for a torn or garbled file
    if not isinstance(p, dict):
      raise CorruptFileError(path, "not a JSON object")
    version = p.get("format_version", 1)  # Files written before the field existed are v1.
    if version != _FORMAT_VERSION:
      raise ValueError(f"{path}: format_version {version!r}, expected "
                       f"{_FORMAT_VERSION}; regenerate the world from its seed")
    try:
      return cls._from_payload(p)
    except (KeyError, TypeError, AttributeError) as e:  # valid JSON, not a whole world
      raise CorruptFileError(path, f"{type(e).__name__}: {e}") from None

  @classmethod
  def _from_payload(cls, p: dict) -> "World":
    cfg = {k: tuple(v) if isinstance(v, list) else v for k, v in p["config"].items()}
    extra = {}
    if "relations" in p:
      config = LessonsWorldConfig(**cfg)
      extra = dict(relations={k: Relation(**{f: tuple(tuple(x) for x in v) if f == "decoys"
                                                 else v for f, v in r.items()})
                              for k, r in p["relations"].items()},
                   lessons=p["lessons"], generation=p.get("generation", {}))
    else:
      config = SyntheticWorldConfig(**cfg)
    return cls(
        config=config, entities=p["entities"], facts=p["facts"],
        corpus=[Doc(**d) for d in p["corpus"]], train=[SyntheticQuestion(**e) for e in p["train"]],
        test=[SyntheticQuestion(**e) for e in p["test"]], twins=p["twins"], traps=p["traps"],
        **extra)


# ---------------------------------------------------------------------------------------------
# Generation.


def _make_names(n: int, rng: np.random.Generator) -> list[str]:
  names, seen = [], set(RESERVED_NAMES)
  while len(names) < n:
    n_syl = rng.choice([2, 2, 3])
    parts = [rng.choice(NAME_ONSETS) + rng.choice(NAME_VOWELS) for _ in range(n_syl)]
    name = ("".join(parts) + rng.choice(NAME_CODAS)).capitalize()
    if 4 <= len(name) <= 9 and name not in seen:
      seen.add(name)
      names.append(name)
  return names


def _twin_of(name: str, taken: set, rng: np.random.Generator) -> Optional[str]:
  """A name one vowel away from `name` that is not taken yet."""
  vowel_pos = [i for i, c in enumerate(name.lower()) if c in NAME_VOWELS]
  for _ in range(10):
    i = int(rng.choice(vowel_pos))
    v = rng.choice([u for u in NAME_VOWELS if u != name[i].lower()])
    twin = name[:i] + (v.upper() if i == 0 else v) + name[i + 1:]
    if twin not in taken:
      return twin
  return None


def _assign_entities(cfg: SyntheticWorldConfig, rng) -> tuple[dict, dict]:
  counts = [max(2, int(round(f * cfg.n_entities))) for f in cfg.type_fractions]
  names = _make_names(sum(counts), rng)
  taken = set(names)
  entities, twins, i = {}, {}, 0
  for etype, count in zip(ENTITY_TYPES, counts):
    block = names[i:i + count]
    i += count
    # Replace a share of the block by one-letter twins of other members of the block.
    n_twins = int(cfg.near_duplicate_rate * count / 2)
    for j in range(n_twins):
      src, dst = 2 * j, 2 * j + 1
      twin = _twin_of(block[src], taken, rng)
      if twin is not None:
        taken.discard(block[dst])
        taken.add(twin)
        block[dst] = twin
        twins[block[src]], twins[twin] = twin, block[src]
    for name in block:
      entities[name] = etype
  return entities, twins


def _by_type(entities: dict) -> dict:
  out = {t: [] for t in ENTITY_TYPES}
  for name, t in entities.items():
    out[t].append(name)
  return out


def _assign_facts(cfg, entities, rng) -> dict:
  by_type = _by_type(entities)
  pick = lambda t: by_type[t][int(rng.integers(len(by_type[t])))]
  facts = {name: {} for name in RELATIONS}
  countries = by_type["country"]
  cities = list(by_type["city"])
  rng.shuffle(cities)
  # Every country gets at least two cities (a capital and a possible old capital); the rest
  # are spread at random.
  for i, city in enumerate(cities):
    country = countries[i % len(countries)] if i < 2 * len(countries) else pick("country")
    facts["city_country"][city] = country
    if i < len(countries):
      facts["capital"][country] = city
  persons = list(by_type["person"])
  founders = [str(p) for p in rng.permutation(persons)]
  for i, c in enumerate(by_type["company"]):
    facts["founded_by"][c] = founders[i % len(founders)]
    facts["company_city"][c] = pick("city")
  founder_set = set(facts["founded_by"].values())
  for p in persons:
    facts["born_in"][p] = pick("city")
    # A founder who works for another company would match "founded X" queries for that
    # company as well as the true founder does; founders studied instead.
    if p not in founder_set and rng.random() < cfg.works_for_rate:
      facts["works_for"][p] = pick("company")
    else:
      facts["studied_at"][p] = pick("university")
  for u in by_type["university"]:
    facts["uni_city"][u] = pick("city")
  return facts


def _plant_traps(cfg, entities, facts, twins, rng) -> dict:
  """Chooses wrong candidates for every trap fact: topk - 1 of them, so with the subject's own
  passage they fill the top-k of the question-worded query."""
  by_type = _by_type(entities)
  n_wrong = max(1, cfg.topk - 1)
  # Sentences beyond the essentials per passage, kept low so passages stay short.
  load = {name: 0 for name in entities}
  for founder in facts["founded_by"].values():
    load[founder] += 1
  traps = {}
  for relation in cfg.trap_relations:
    rel = RELATIONS[relation]
    pool = by_type[rel.object_type]
    for subject, true_obj in facts[relation].items():
      excluded = {true_obj, subject}
      if relation == "founded_by":
        # A founder or employee of another company carrying "founder of X" would also match
        # queries about that company; wrong founders have no company of their own.
        busy = set(facts["works_for"]) | set(facts["founded_by"].values())
        pool = [p for p in by_type["person"] if p not in busy]
      elif relation == "capital":
        # The old capital is another city of the same country; its passage states the country
        # only through the misleading sentence, so "capital" + country name singles it out.
        pool = [c for c, k in facts["city_country"].items()
                if k == subject and c != true_obj and load[c] == 0]
      wrong = []
      twin = twins.get(true_obj)
      if twin is not None and twin not in excluded and twin in pool and load[twin] == 0:
        wrong.append(twin)
      while len(wrong) < n_wrong:
        cands = [c for c in pool if c not in excluded and c not in wrong]
        if not cands:
          break
        least = min(load[c] for c in cands)
        cands = [c for c in cands if load[c] == least]
        wrong.append(cands[int(rng.integers(len(cands)))])
      if not wrong:
        continue  # E.g. a country with a single city: no old capital to plant.
      for w in wrong:
        load[w] += 1
      traps[f"{relation}|{subject}"] = wrong
  return traps


def _write_corpus(cfg, entities, facts, twins, traps, rng) -> list[Doc]:
  by_type = _by_type(entities)
  sentences = {name: [] for name in entities}
  for name, etype in entities.items():
    if etype in TYPE_INTROS:
      sentences[name].append(TYPE_INTROS[etype].format(s=name))
  capitals = {city: country for country, city in facts["capital"].items()}
  old_capitals = {w for key, ws in traps.items() if key.startswith("capital|") for w in ws}
  for relation, table in facts.items():
    rel = RELATIONS[relation]
    for s, o in table.items():
      if relation == "city_country" and (s in capitals or s in old_capitals):
        continue  # Stated by the capital or old-capital sentence.
      text = rel.fact.format(s=s, o=o)
      sentences[o if rel.on_object_side else s].append(text)
  for key, wrong in traps.items():
    relation, subject = key.split("|")
    for w in wrong:
      sentences[w].append(RELATIONS[relation].misleading.format(w=w, s=subject))
  for name, etype in entities.items():
    for _ in range(cfg.distractors_per_passage):
      # Mention the twin of something this passage talks about when there is one.
      mentioned = [t for t in re.findall(r"[A-Z][a-z]+", " ".join(sentences[name]))
                   if t != name and entities.get(t) == etype and t in twins]
      if mentioned and rng.random() < 0.5:
        y = twins[mentioned[int(rng.integers(len(mentioned)))]]
      else:
        y = by_type[etype][int(rng.integers(len(by_type[etype])))]
      n_words = sum(len(x.split()) for x in sentences[name])
      if y != name and n_words + 5 <= cfg.max_passage_words:
        sentences[name].append(DISTRACTOR_TEMPLATES[etype].format(s=name, y=y))
  corpus = []
  for name in entities:
    corpus.append(Doc(id=name, title=name, text=" ".join(sentences[name])))
  return corpus


def _sample_chain(start, n_hops, entities, facts, rng):
  chain, relations, current = [start], [], start
  for _ in range(n_hops):
    options = [r for r in NEXT_RELATIONS_BY_TYPE[entities[current]]
               if current in facts[r]
               and not (relations and (relations[-1], r) in FORBIDDEN_RELATION_PAIRS)]
    if not options:
      return None
    r = options[int(rng.integers(len(options)))]
    nxt = facts[r][current]
    if nxt in chain:
      return None
    relations.append(r)
    chain.append(nxt)
    current = nxt
  return relations, chain


def question_text(start: str, relations: Sequence[str], schema: Optional[dict] = None) -> str:
  schema = RELATIONS if schema is None else schema
  np_ = start
  for r in relations:
    np_ = f"the {schema[r].noun} of {np_}"
  return f"what is {np_} ?"


def _chain_facts(ex: SyntheticQuestion) -> set:
  return set(zip(ex.meta["relations"], ex.meta["chain"][:-1]))


def _make_questions(cfg, entities, facts, starts, n, split, rng, world_view,
                    exclude_facts=frozenset()) -> list[SyntheticQuestion]:
  weights = np.asarray(cfg.hop_weights, dtype=np.float64)
  weights = weights / weights.sum()
  out, seen = [], set()
  attempts = since_new = 0
  # A small world runs out of distinct questions; stop once new ones have become rare.
  while len(out) < n and attempts < 20 * n and since_new < 500:
    attempts += 1
    since_new += 1
    n_hops = int(rng.choice(len(weights), p=weights)) + 1
    # Long chains exist from few start types; retry starts so the hop mix follows the weights.
    for _ in range(100):
      start = starts[int(rng.integers(len(starts)))]
      sampled = _sample_chain(start, n_hops, entities, facts, rng)
      if sampled is not None:
        break
    if sampled is None:
      continue
    relations, chain = sampled
    if exclude_facts and any(f in exclude_facts for f in zip(relations, chain[:-1])):
      continue
    q = question_text(start, relations)
    if q in seen:
      continue
    seen.add(q)
    since_new = 0
    needed = [world_view(r, s) for r, s in zip(relations, chain[:-1])]
    out.append(SyntheticQuestion(
        id=f"{split}-{len(out)}", question=q, answers=[chain[-1]], hops=n_hops,
        meta={"start": start, "relations": relations, "chain": chain,
              "needed_doc_ids": needed, "split": split},
    ))
  return out


def generate_world(cfg: Optional[SyntheticWorldConfig] = None) -> World:
  """Builds a world from `cfg` (defaults: seed 0, 2000 entities). Deterministic in the seed."""
  cfg = cfg or SyntheticWorldConfig()
  if len(cfg.type_fractions) != len(ENTITY_TYPES):
    raise ValueError(f"type_fractions needs {len(ENTITY_TYPES)} entries {ENTITY_TYPES}")
  if not 1 <= len(cfg.hop_weights) <= 4:
    raise ValueError("hop_weights gives P(1..n hops) for n <= 4")
  unknown = set(cfg.trap_relations) - {r for r in RELATIONS if RELATIONS[r].misleading}
  if unknown:
    raise ValueError(f"trap relations must be among {['founded_by', 'capital']}, got {unknown}")
  rng = np.random.default_rng(cfg.seed)
  entities, twins = _assign_entities(cfg, rng)
  facts = _assign_facts(cfg, entities, rng)
  traps = _plant_traps(cfg, entities, facts, twins, rng)
  corpus = _write_corpus(cfg, entities, facts, twins, traps, rng)
  world = World(cfg, entities, facts, corpus, [], [], twins, traps)

  names = list(entities)
  order = rng.permutation(len(names))
  n_test_starts = max(1, int(cfg.test_start_fraction * len(names)))
  test_starts = [names[i] for i in order[:n_test_starts]]
  train_starts = [names[i] for i in order[n_test_starts:]]
  make = lambda starts, n, split, exclude=frozenset(): _make_questions(
      cfg, entities, facts, starts, n, split, rng, world.needed_doc_id, exclude)
  if cfg.holdout_test_facts:
    world.test = make(test_starts, cfg.n_test, "test")
    held_out = set().union(*(_chain_facts(ex) for ex in world.test))
    world.train = make(train_starts, cfg.n_train, "train", held_out)
  else:
    world.train = make(train_starts, cfg.n_train, "train")
    world.test = make(test_starts, cfg.n_test, "test")
  return world
