"""A many-lessons world: K independent things to learn, found at different times.

The embedded world (`synthetic_world`) holds one rule; this one holds K (DESIGN.md §3 asks for a
world where allocation can matter, and this is built on principle, not for one method):

  * K relations, each with its own question noun and W query verbs (made-up lowercase words, one
    token each, unique to the relation). One verb, chosen at random per relation, is the verb of
    the fact sentences ("Kelmor velkors Zantro ."); each other verb is a *decoy*: a planted
    sentence naming a wrong candidate ("Rudra tompas Zantro .") answers
    exactly that wording. Passages are single sentences without titles, so a query's verb and
    name single out the sentence that holds both. A *lesson* is "for relation k, query with
    its fact verb". Nothing is shared between lessons: the question's noun names none of the
    verbs, and which verb is right is drawn per relation, so learning one says nothing of
    another.
  * Relation frequency is long-tailed (weights 1 / rank^zipf_exponent over a random order), and
    the expert's rate of using the fact verb (`expert_rate`, epsilon_k; evenly spaced over a
    range) is paired with relations independently of frequency, so some lessons are rare *and*
    hard to stumble on.
  * 2 to 4 hops; any hop may be a lesson the policy has not learned, so prefixes before such a hop
    are real branching points and prefixes after it are decided.
  * No name ceiling: every name a held-out question's chain passes through appears in some train
    chain (held-out questions are unseen combinations of seen entities and relations), and
    near-duplicate names are rare.
  * The scripted oracle (fact verb every hop) answers every question: a question whose oracle
    search would not show its fact is not kept (`generate_lessons_world` counts them).

Everything else (BM25 retrieval, the ReAct protocol, expert traces, tokenizer, `World`'s file
format) is the embedded world's, so a run switches worlds with `world.kind=lessons`.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from trace_jax.envs.tasks.problem_world import stratified_rates
from trace_jax.envs.worlds.synthetic_schema import NAME_CODAS, NAME_ONSETS, NAME_VOWELS, Relation
from trace_jax.envs.worlds.synthetic_world import (  # noqa: F401  (LessonsWorldConfig re-exported)
    LessonsWorldConfig, SyntheticQuestion, World, _make_names, _twin_of, question_text,
)
from trace_jax.envs.types import Doc

ENTITY_TYPE = "entity"
# Question nouns, one per relation (K at most this many).
NOUNS = ("mentor", "rival", "patron", "heir", "ally", "sponsor", "tutor", "partner", "deputy",
         "successor", "guardian", "advisor", "critic", "neighbor", "student", "envoy", "agent",
         "backer", "steward", "herald", "warden", "scribe", "healer", "captain", "keeper",
         "trainer", "broker", "courier", "editor", "judge", "pilot", "singer", "ranger", "mayor",
         "archer", "bishop", "porter", "sheriff", "tailor", "vendor")


def _make_verbs(n: int, taken: set, rng: np.random.Generator) -> list[str]:
  """`n` distinct made-up lowercase verbs, none equal to a lowercased name in `taken`."""
  out, seen = [], {t.lower() for t in taken}
  while len(out) < n:
    parts = [rng.choice(NAME_ONSETS) + rng.choice(NAME_VOWELS) for _ in range(2)]
    verb = "".join(parts) + rng.choice(NAME_CODAS) + "s"
    if verb not in seen and 5 <= len(verb) <= 10:
      seen.add(verb)
      out.append(verb)
  return out


def lesson_relations(cfg: LessonsWorldConfig, names: set, rng) -> tuple[dict, dict]:
  """The K lesson relations (`Relation` with `decoys`), then the plain ones (one verb, no decoy),
  and per lesson relation its lesson facts: `weight` (question frequency), `expert_rate`,
  `fact_verb` and `decoy_verbs`."""
  k, w, n_plain = cfg.n_relations, cfg.n_wordings, cfg.n_plain_relations
  if not 1 <= k <= len(NOUNS):
    raise ValueError(f"n_relations must be in [1, {len(NOUNS)}], got {k}")
  if not 0 <= n_plain <= len(NOUNS) - k:
    raise ValueError(f"n_plain_relations must be in [0, {len(NOUNS) - k}] with n_relations={k}, "
                     f"got {n_plain}")
  if cfg.one_lesson_per_question != (n_plain > 0):
    raise ValueError("one_lesson_per_question and n_plain_relations > 0 go together (plain "
                     f"relations are the other hops), got {cfg.one_lesson_per_question} and "
                     f"{n_plain}")
  if w < 2:
    raise ValueError(f"n_wordings must be >= 2 (a fact verb and a decoy), got {w}")
  lo, hi = cfg.expert_rate_range
  if not 0.0 <= lo <= hi <= 1.0:
    raise ValueError(f"expert_rate_range must satisfy 0 <= lo <= hi <= 1, got {(lo, hi)}")
  verbs = _make_verbs(k * w + n_plain, names, rng)
  ranks = rng.permutation(k)
  # Stratified: every world has the same spread of difficulty, and only its pairing with
  # frequency (drawn independently) differs between seeds.
  rates = stratified_rates(rng, k, lo, hi, cfg.expert_rate_spacing)
  relations, lessons = {}, {}
  for i in range(k):
    own = verbs[i * w:(i + 1) * w]
    m = int(rng.integers(w))
    fact_verb, decoys = own[m], own[:m] + own[m + 1:]
    name = f"r{i:02d}_{NOUNS[i]}"
    relations[name] = Relation(
        name=name, subject_type=ENTITY_TYPE, object_type=ENTITY_TYPE,
        fact=f"{{o}} {fact_verb} {{s}} .", noun=NOUNS[i], query_passage=f"{fact_verb} {{x}}",
        on_object_side=True,
        decoys=tuple((f"{v} {{x}}", f"{{w}} {v} {{s}} .") for v in decoys))
    lessons[name] = dict(weight=float(1.0 / (ranks[i] + 1) ** cfg.zipf_exponent),
                         expert_rate=float(rates[i]), fact_verb=fact_verb,
                         decoy_verbs=list(decoys))
  for i in range(n_plain):
    verb, name = verbs[k * w + i], f"p{i:02d}_{NOUNS[k + i]}"
    relations[name] = Relation(
        name=name, subject_type=ENTITY_TYPE, object_type=ENTITY_TYPE, fact=f"{{o}} {verb} {{s}} .",
        noun=NOUNS[k + i], query_passage=f"{verb} {{x}}", on_object_side=True, decoys=())
  return relations, lessons


def _assign_facts(cfg, names, relations, lessons, rng) -> dict:
  """Every entity is the subject of `out_degree` lesson relations (drawn by frequency; evenly
  with `one_lesson_per_question`, where the question sampler sets the frequency, so rare lessons
  still have subjects) and of every plain relation."""
  rel_names = list(lessons)
  weights = np.asarray([lessons[r]["weight"] for r in rel_names])
  if cfg.one_lesson_per_question:
    weights = np.ones_like(weights)
  weights = weights / weights.sum()
  facts = {r: {} for r in relations}
  n = len(names)

  def other(s):
    o = names[int(rng.integers(n))]
    while o == s:
      o = names[int(rng.integers(n))]
    return o

  for s in names:
    d = int(rng.choice(cfg.out_degree))
    for ri in rng.choice(len(rel_names), size=min(d, len(rel_names)), replace=False, p=weights):
      facts[rel_names[ri]][s] = other(s)
  # A plain relation is one-to-one: a query "verb X" then matches its fact and at most one other
  # sentence (the one naming X as its object), so the fact is always among the top two passages
  # (a many-to-one relation would let two sentences naming X as object outrank it on ties).
  for r in relations:
    if r not in lessons:
      perm = rng.permutation(n)
      for i in range(n):
        if perm[i] == i:  # no entity is its own object
          j = (i + 1) % n
          perm[i], perm[j] = perm[j], perm[i]
      facts[r] = {names[i]: names[int(perm[i])] for i in range(n)}
  return facts


def _sample_chain(start, n_hops, facts, weights, rng):
  chain, relations, current = [start], [], start
  for _ in range(n_hops):
    options = [r for r in facts if current in facts[r] and facts[r][current] not in chain]
    if not options:
      return None
    p = np.asarray([weights[r] for r in options])
    r = options[int(rng.choice(len(options), p=p / p.sum()))]
    relations.append(r)
    current = facts[r][current]
    chain.append(current)
  return relations, chain


def _sample_lesson_chain(start, n_hops, pos, lesson, facts, plain, rng):
  """A chain of `n_hops` from `start` whose hop `pos` is relation `lesson` and every other hop a
  plain relation (drawn evenly among those continuing the chain), or None."""
  chain, relations, current = [start], [], start
  for i in range(n_hops):
    if i == pos:
      options = [lesson] if current in facts[lesson] and facts[lesson][current] not in chain \
          else []
    else:
      options = [r for r in plain if current in facts[r] and facts[r][current] not in chain]
    if not options:
      return None
    r = options[int(rng.integers(len(options)))]
    relations.append(r)
    current = facts[r][current]
    chain.append(current)
  return relations, chain


def generate_lessons_world(cfg: Optional[LessonsWorldConfig] = None) -> World:
  """Builds a lessons world from `cfg` (defaults: seed 0). Deterministic in the seed.

  Steps: names (a few one-letter twins), the K relations and their lessons, every entity's facts
  (relations drawn by weight), questions (relations drawn by weight along the chain), a train /
  held-out split in which every held-out chain's names occur in train chains, then the corpus
  (`_write_corpus`: one passage a sentence, each fact and its planted decoys).
  Questions whose oracle search (the fact verb) would not read the true object are dropped.
  """
  cfg = cfg or LessonsWorldConfig()
  if not 1 <= len(cfg.hop_weights) <= 4 or sum(cfg.hop_weights) <= 0:
    raise ValueError("hop_weights gives P(1..n hops) for n <= 4, with a positive total")
  rng = np.random.default_rng(cfg.seed)
  names = _make_names(cfg.n_entities, rng)
  taken, twins = set(names), {}
  for j in range(int(cfg.near_duplicate_rate * len(names) / 2)):
    src, dst = 2 * j, 2 * j + 1
    twin = _twin_of(names[src], taken, rng)
    if twin is not None:
      taken.discard(names[dst])
      taken.add(twin)
      names[dst] = twin
      twins[names[src]], twins[twin] = twin, names[src]
  relations, lessons = lesson_relations(cfg, taken, rng)
  facts = _assign_facts(cfg, names, relations, lessons, rng)
  weights = {r: lessons[r]["weight"] for r in lessons}

  # Questions, then the split.
  hop_p = np.asarray(cfg.hop_weights, np.float64)
  hop_p = hop_p / hop_p.sum()
  lesson_names = list(lessons)
  plain = [r for r in relations if r not in lessons]
  seen = set()

  def draw(want, lesson_p, keep=lambda chain: True):
    """Up to `want` new questions; with one lesson per question its relation is drawn from
    `lesson_p` and its hop evenly."""
    out, attempts, since_new = [], 0, 0
    while len(out) < want and attempts < 400 * want and since_new < 20000:
      attempts += 1
      since_new += 1
      n_hops = int(rng.choice(len(hop_p), p=hop_p)) + 1
      start = names[int(rng.integers(len(names)))]
      if cfg.one_lesson_per_question:
        lesson = lesson_names[int(rng.choice(len(lesson_names), p=lesson_p))]
        sampled = _sample_lesson_chain(start, n_hops, int(rng.integers(n_hops)), lesson, facts,
                                       plain, rng)
      else:
        sampled = _sample_chain(start, n_hops, facts, weights, rng)
      if sampled is None or not keep(sampled[1]):
        continue
      rels, chain = sampled
      q = question_text(start, rels, relations)
      if q in seen:
        continue
      seen.add(q)
      since_new = 0
      out.append((start, rels, chain, q))
    return out

  freq = np.asarray([weights[r] for r in lesson_names])
  freq = freq / freq.sum()
  if cfg.balanced_test:
    if not cfg.one_lesson_per_question:
      raise ValueError("balanced_test needs one_lesson_per_question (a question per lesson)")
    # Train questions first (long-tailed); then held-out ones lesson by lesson, from names the
    # train chains pass through (a few spare for the oracle's check).
    train_q = draw(int(1.03 * cfg.n_train), freq)
    train_names = {x for _, _, chain, _ in train_q for x in chain}
    per = cfg.n_test // len(lesson_names)
    test_pool = []
    for j in range(len(lesson_names)):
      one = np.eye(len(lesson_names))[j]
      test_pool += draw(per + 2, one, keep=lambda chain: set(chain) <= train_names)
  else:
    want = int(1.15 * (cfg.n_train + cfg.n_test))
    questions = draw(want, freq)
    order = rng.permutation(len(questions))
    n_test_pool = int(round(len(questions) * cfg.n_test / (cfg.n_train + cfg.n_test)))
    test_pool = [questions[i] for i in order[:n_test_pool]]
    train_q = [questions[i] for i in order[n_test_pool:]]
  train_q = train_q[:cfg.n_train]
  corpus = _write_corpus(cfg, names, relations, facts, rng)
  world = World(cfg, {n: ENTITY_TYPE for n in names}, facts, corpus, [], [], twins, {},
                relations=relations, lessons=lessons)
  keep = lambda qs: [q for q in qs if _oracle_reads(world, q[1], q[2])]  # noqa: E731
  train_kept = keep(train_q)
  # Held-out chains made only of names the kept train chains pass through (the rest are
  # dropped, not moved: moving them would change which names training sees).
  train_names = {x for _, _, chain, _ in train_kept for x in chain}
  named = [q for q in test_pool if set(q[2]) <= train_names]
  named_kept = keep(named)
  if cfg.balanced_test:  # n_test / K of each lesson
    per, test_kept = cfg.n_test // len(lesson_names), []
    for r in lesson_names:
      test_kept += [q for q in named_kept if r in q[1]][:per]
  else:
    test_kept = named_kept[:cfg.n_test]
  for split, qs in (("train", train_kept), ("test", test_kept)):
    out = [SyntheticQuestion(id=f"{split}-{i}", question=q, answers=[chain[-1]], hops=len(rels),
                             meta={"start": start, "relations": list(rels), "chain": list(chain),
                                   "needed_doc_ids": [fact_doc_id(r, s) for r, s in
                                                      zip(rels, chain[:-1])],
                                   "split": split})
           for i, (start, rels, chain, q) in enumerate(qs)]
    setattr(world, split, out)
  world.generation = dict(
      questions_sampled=len(seen), train_dropped_by_oracle=len(train_q) - len(train_kept),
      test_dropped_for_unseen_names=len(test_pool) - len(named),
      test_dropped_by_oracle=len(named) - len(named_kept))
  return world


def _write_corpus(cfg, names, relations, facts, rng) -> list:
  """One passage per sentence, without a title (so each name occurs once in a passage and a
  query's two words single out the one sentence holding both): every fact, and for every fact
  one planted sentence per decoy verb naming `topk - 1` wrong candidates."""
  n_wrong = max(1, cfg.topk - 1)
  corpus = []
  for r, table in facts.items():
    rel = relations[r]
    for s, o in table.items():
      corpus.append(Doc(id=fact_doc_id(r, s), title="", text=rel.fact.format(s=s, o=o)))
      for j, (_, misleading) in enumerate(rel.decoys):
        for i in range(n_wrong):
          w = names[int(rng.integers(len(names)))]
          while w in (s, o):
            w = names[int(rng.integers(len(names)))]
          corpus.append(Doc(id=f"{fact_doc_id(r, s)}:{j}:{i}", title="",
                            text=misleading.format(w=w, s=s)))
  return [corpus[i] for i in rng.permutation(len(corpus))]


def fact_doc_id(relation: str, subject: str) -> str:
  """The id of the passage stating `relation(subject)` in a lessons world."""
  return f"{relation}:{subject}"


def _oracle_reads(world: World, rels, chain) -> bool:
  from trace_jax.envs.worlds.synthetic_traces import read_fact

  for r, s, o in zip(rels, chain[:-1], chain[1:]):
    docs = world.search([world.relations[r].query_passage.format(x=s)])[0]
    found, _, misled = read_fact(docs, r, s, world.relations)
    if found != o or misled:
      return False
  return True


def wording_use(world: World, texts) -> dict:
  """{relation: [fact-verb uses, searches]} over the search actions in `texts` (turn texts of
  rollouts) whose query starts with one of a relation's verbs: how far each lesson is learned,
  read off the policy's own queries (held-out EM per lesson mixes in the other lessons a
  question needs)."""
  from trace_jax.envs.react import parse_action

  verb_of = {}
  for r, v in world.lessons.items():
    verb_of[v["fact_verb"]] = (r, True)
    verb_of.update({d: (r, False) for d in v["decoy_verbs"]})
  out = {r: [0, 0] for r in world.lessons}
  for text in texts:
    action = parse_action(text)
    if action.kind != "search" or not action.content:
      continue
    hit = verb_of.get(action.content.split()[0])
    if hit is not None:
      out[hit[0]][0] += hit[1]
      out[hit[0]][1] += 1
  return out


def wording_rates(world: World, trees) -> dict:
  """`wording_use` over every generated turn of `trees`, as {relation: fact-verb share} for the
  relations searched at least once."""
  use = wording_use(world, (n.text for t in trees for n in t.nodes[1:] if n.text))
  return {r: hits / n for r, (hits, n) in use.items() if n}
