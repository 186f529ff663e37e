"""The embedded synthetic multi-hop world: public API and a statistics report.

  world = generate_world(SyntheticWorldConfig(seed=0))
  trace = expert_trace(world, world.train[0], np.random.default_rng(0))
  python -m trace_jax.envs.worlds.synthetic --seed 0 --stats
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import time
from typing import Optional

import numpy as np

from trace_jax.envs.worlds.synthetic_tokenizer import build_hf_tokenizer, build_tokenizer
from trace_jax.envs.worlds.synthetic_traces import (
    SFTRecord, Trace, expert_trace, make_sft_dataset, oracle_world, read_fact, trace_segments,
)
from trace_jax.envs.worlds.synthetic_world import (
    RELATIONS, SyntheticQuestion, SyntheticWorldConfig, World, generate_world, question_text,
)

__all__ = [
    "RELATIONS", "SyntheticQuestion", "SFTRecord", "SyntheticWorldConfig", "Trace", "World",
    "build_hf_tokenizer", "build_tokenizer", "expert_trace", "generate_world",
    "make_sft_dataset", "oracle_world", "question_text", "read_fact", "trace_segments",
    "world_stats",
]


def _rate(hits: list) -> Optional[float]:
  return round(float(np.mean(hits)), 3) if hits else None


def retrieval_stats(world: World, examples: list[SyntheticQuestion]) -> dict:
  """Hit@k of the needed passage for each hop of `examples`, by wording, trap vs other."""
  k = world.config.topk
  rows = []  # (is_trap, wording, hit, misleading_in_topk)
  pairs = {(r, s) for ex in examples
           for r, s in zip(ex.meta["relations"], ex.meta["chain"][:-1])}
  pairs = sorted(pairs)
  for wording in ("question", "passage"):
    queries = [RELATIONS[r].question_query(s) if wording == "question"
               else RELATIONS[r].query_passage.format(x=s) for r, s in pairs]
    for (r, s), docs in zip(pairs, world.search(queries, k)):
      need = world.needed_doc_id(r, s)
      wrong = set(world.traps.get(f"{r}|{s}", ()))
      rows.append((r in world.config.trap_relations, wording, any(d.id == need for d in docs),
                   any(d.id in wrong for d in docs)))
  out = {}
  for trap in (True, False):
    for wording in ("question", "passage"):
      sel = [row for row in rows if row[0] == trap and row[1] == wording]
      key = f"{'trap' if trap else 'other'}_{wording}_wording"
      out[key + "_hit_at_k"] = _rate([row[2] for row in sel])
      if trap:
        out[key + "_misleading_in_top_k"] = _rate([row[3] for row in sel])
  # One query with the raw question text: does its top-k hold every needed passage?
  docs = world.search([ex.question for ex in examples], k)
  by_hop = collections.defaultdict(list)
  for ex, ds in zip(examples, docs):
    ids = {d.id for d in ds}
    by_hop[ex.hops].append(all(n in ids for n in ex.meta["needed_doc_ids"]))
  out["raw_question_all_needed_in_top_k_by_hops"] = {h: _rate(v) for h, v in sorted(by_hop.items())}
  out["raw_question_all_needed_in_top_k"] = _rate([x for v in by_hop.values() for x in v])
  return out


def expert_stats(world: World, examples: list[SyntheticQuestion], traces_per_example: int,
                 seed: int, tokenizer=None) -> dict:
  """Expert success by hop count, by trap wording, and trace lengths in tokens."""
  rng = np.random.default_rng(seed)
  by_hop = collections.defaultdict(list)
  after_bad, after_good, trap_wordings, mixed = [], [], [], []
  lengths, obs_lengths = [], []
  for ex in examples:
    outcomes = []
    for _ in range(traces_per_example):
      tr = expert_trace(world, ex, rng)
      by_hop[ex.hops].append(tr.correct)
      outcomes.append(tr.correct)
      trap_wordings += [s["wording"] == "question" for s in tr.meta["searches"]
                        if s["relation"] in world.config.trap_relations]
      trap_searches = [s for s in tr.meta["searches"]
                       if s["relation"] in world.config.trap_relations and not tr.meta["errors"]]
      if trap_searches:
        bad = any(s["wording"] == "question" for s in trap_searches)
        (after_bad if bad else after_good).append(tr.correct)
      if tokenizer is not None:
        segs = trace_segments(ex, tr)
        lengths.append(sum(len(tokenizer.encode(t).ids) for t, _ in segs))
        obs_lengths += [len(tokenizer.encode(t).ids) for t, gen in segs[1:] if not gen]
    mixed.append(0 < sum(outcomes) < len(outcomes))
  out = {
      "success_by_hops": {h: _rate(v) for h, v in sorted(by_hop.items())},
      "success": _rate([x for v in by_hop.values() for x in v]),
      # Questions whose expert traces have both a success and a failure (the effective ratio
      # a policy as good as the expert would see with this many rollouts).
      f"mixed_share_over_{traces_per_example}_traces": _rate(mixed),
      "trap_question_wording_share": _rate(trap_wordings),
      "trap_success_after_question_wording": _rate(after_bad),
      "trap_success_after_passage_wording": _rate(after_good),
  }
  if lengths:
    out["trace_tokens_mean"] = round(float(np.mean(lengths)), 1)
    out["trace_tokens_max"] = int(np.max(lengths))
    out["observation_tokens_mean"] = round(float(np.mean(obs_lengths)), 1)
    out["observation_tokens_max"] = int(np.max(obs_lengths))
  return out


def world_stats(world: World, traces_per_example: int = 4, seed: int = 0) -> dict:
  """The numbers that say whether a world is fit for the method (see DESIGN.md §3)."""
  tokenizer = build_tokenizer(world)
  types = collections.Counter(world.entities.values())
  words = [len(d.text.split()) for d in world.corpus]
  train_facts = {(r, s) for ex in world.train
                 for r, s in zip(ex.meta["relations"], ex.meta["chain"][:-1])}
  test_facts = [(r, s) for ex in world.test
                for r, s in zip(ex.meta["relations"], ex.meta["chain"][:-1])]
  return {
      "entities": len(world.entities),
      "entities_by_type": dict(types),
      "near_duplicate_names": len(world.twins),
      "passages": len(world.corpus),
      "passage_words_mean": round(float(np.mean(words)), 1),
      "passage_words_max": int(np.max(words)),
      "vocab_size": tokenizer.get_vocab_size(),
      "train_questions": len(world.train),
      "test_questions": len(world.test),
      "hops_train": dict(sorted(collections.Counter(ex.hops for ex in world.train).items())),
      "hops_test": dict(sorted(collections.Counter(ex.hops for ex in world.test).items())),
      "test_facts_seen_in_train_chains": _rate([f in train_facts for f in test_facts]),
      "test_questions_with_a_trap_relation": _rate(
          [bool(set(ex.meta["relations"]) & set(world.config.trap_relations))
           for ex in world.test]),
      "retrieval_test": retrieval_stats(world, world.test),
      "expert_test": expert_stats(world, world.test, traces_per_example, seed, tokenizer),
  }


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--n_entities", type=int, default=SyntheticWorldConfig.n_entities)
  parser.add_argument("--n_train", type=int, default=SyntheticWorldConfig.n_train)
  parser.add_argument("--n_test", type=int, default=SyntheticWorldConfig.n_test)
  parser.add_argument("--stats", action="store_true", help="print world statistics as JSON")
  parser.add_argument("--save", default=None, help="directory to save the world to")
  args = parser.parse_args(argv)
  t0 = time.time()
  world = generate_world(SyntheticWorldConfig(
      seed=args.seed, n_entities=args.n_entities, n_train=args.n_train, n_test=args.n_test))
  gen_s = time.time() - t0
  if args.save:
    world.save(args.save)
  if args.stats:
    stats = world_stats(world)
    stats["generation_seconds"] = round(gen_s, 2)
    stats["config"] = dataclasses.asdict(world.config)
    print(json.dumps(stats, indent=1))
  else:
    print(f"generated {len(world.corpus)} passages, {len(world.train)} train / "
          f"{len(world.test)} test questions in {gen_s:.1f}s")


if __name__ == "__main__":
  main()
