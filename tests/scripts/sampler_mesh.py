"""The sampler engine on a (data 2, fsdp 2, tensor 2) mesh of 8 fake CPU devices vs one device.

Run by tests/test_sampler_sharded.py in a fresh interpreter (the device count is fixed at jax
start). Prints one JSON line of measured facts; the test asserts on them.
"""

import json
import re
import sys

import jax
from flax import nnx

from trace_jax.models.qwen3 import Qwen3, get_preset
from trace_jax.parallel import make_mesh
from trace_jax.sampling.engine import ForkRequest, PromptRequest, SamplerConfig, SamplerEngine
from trace_jax.sampling.testing import IdTokenizer, ScriptedEnv, check_against_forward

V = 64
EOS, SEARCH, ANSWER = 1, 5, 6
TOK = IdTokenizer({SEARCH: "</search>", ANSWER: "</answer>"})
PROMPTS = [[3, 9, 12, 17, 22, 30, 41], [10, 11, 12], list(range(20, 38))]


def make_engine(model, mesh=None, **kw):
  base = dict(num_slots=8, page_size=4, num_pages=512, max_seq_len=96, max_turn_tokens=7,
              max_obs_tokens=12, max_turns=4, prefill_chunk=(16,), page_buckets=(24,), greedy=True,
              max_group_size=2, max_groups=4, prefill_batch=4)
  base.update(kw)
  return SamplerEngine(model[0], model[1], SamplerConfig(**base), TOK.encode, TOK.decode,
                       ScriptedEnv(V), eos_id=EOS, mesh=mesh)


def two_stage(engine, n=2, k=2):
  trees = engine.run([PromptRequest(p, n=n) for p in PROMPTS])
  engine.run([ForkRequest(t, a.id, k) for t in trees for a in t.anchors() if a.depth in (0, 1, 2)])
  return trees


def leaves(trees):
  return [sorted(tuple(t.path_tokens(leaf.id)[0]) for leaf in t.leaves()) for t in trees]


def spec_of(x):
  return tuple(x.sharding.spec)


def main():
  assert jax.device_count() == 8, jax.device_count()
  gd, st = nnx.split(Qwen3(get_preset("tiny", vocab_size=V), rngs=nnx.Rngs(0)))
  st = jax.tree.map(lambda x: x * 6.0, st)
  model = (gd, st)
  mesh = make_mesh("data:2,fsdp:2,tensor:2")
  res = {}

  single = two_stage(make_engine(model, decode_steps=4))
  engine = make_engine(model, mesh, decode_steps=4)
  res["pool_spec_before"] = [str(s) for s in spec_of(engine.pool["k"][0])]
  res["pool_shard_shape"] = list(engine.pool["v"][1].addressable_shards[0].data.shape)
  res["weight_specs"] = sorted({str(tuple(variable.sharding.spec)) for variable in
                                jax.tree.leaves(engine.state)})
  seen = {}
  step = engine._decode

  def spy(state, pool, batch):
    seen["batch"] = batch
    pool, out = step(state, pool, batch)
    seen["out_spec"] = [str(s) for s in spec_of(out["tokens"])]
    return pool, out

  engine._decode = spy
  free0 = engine.alloc.num_free
  trees = two_stage(engine)
  res["same_tokens_as_one_device"] = leaves(trees) == leaves(single)
  res["oracle"] = check_against_forward(trees, *model, greedy=True)
  res["pool_spec_after"] = [str(s) for s in spec_of(engine.pool["k"][0])]
  res["out_spec"] = seen["out_spec"]
  n = engine.alloc.pages_per_shard
  states = [engine.tree_state(t) for t in trees]
  res["trees_on_one_shard"] = all(
      len({p // n for pages in s.page_refs for p in pages}) == 1 and
      all(p // n == s.shard for pages in s.page_refs for p in pages) for s in states)
  res["tree_shards"] = sorted(s.shard for s in states)
  res["forks"] = sum(len(n.children) > 1 for t in trees for n in t.nodes)
  # The compiled decode: collectives and whether any gathers a pool-sized array.
  hlo = step.lower(engine.state, engine.pool, seen["batch"]).compile().as_text()
  gathers = [ln for ln in hlo.splitlines() if re.search(r"= \S+ all-gather", ln)]
  pool_local = engine.pool["k"][0].addressable_shards[0].data.shape
  big = [ln for ln in gathers if f"[{engine.cfg.num_pages}," in ln or
         f"[{pool_local[0]}," in ln and f",{engine.cfg.page_size}," in ln]
  res["all_gathers"] = len(gathers)
  res["pool_all_gathers"] = big[:3]
  res["all_gather_shapes"] = sorted({re.search(r"= (\S+) all-gather", ln).group(1)
                                     for ln in gathers})
  # Prompt scoring on the same mesh: rows split over the data shards, features as on one device.
  score = engine._features

  def score_spy(state, tokens, lens):
    out = score(state, tokens, lens)
    seen["features_spec"] = [str(s) for s in spec_of(out)]
    return out

  engine._features = score_spy
  scored = PROMPTS + [[7, 8, 9, 10]] * 3  # 6 prompts: two batches of 4 rows
  f_mesh = engine.prompt_features(scored)
  f_one = make_engine(model).prompt_features(scored)
  res["features_spec"] = seen["features_spec"]
  res["features_shape"] = list(f_mesh.shape)
  res["features_max_abs_vs_one_device"] = float(abs(f_mesh - f_one).max())
  engine._features = score
  # Warm: the same workload again compiles nothing.
  before = engine.compile_counts()
  engine.release(trees)
  res["released_all"] = engine.alloc.num_free == free0 == engine.alloc.capacity
  two_stage(engine)
  res["recompiled"] = engine.compile_counts() != before
  engine.release()
  # A scored pool kept on the mesh: features as on one device, the sampled trees reuse the kept
  # pages (on their shards) and sample the single device's tokens, nothing leaks.
  free0 = engine.alloc.num_free
  f_kept = engine.prompt_features(scored, keep=True)
  res["kept_features_max_abs_vs_one_device"] = float(abs(f_kept - f_one).max())
  pre = engine.ledger.prefill_tokens
  kept_trees = engine.run([PromptRequest(p, n=2) for p in PROMPTS])
  res["kept_same_tokens"] = leaves(kept_trees) == leaves(
      make_engine(model).run([PromptRequest(p, n=2) for p in PROMPTS]))
  res["kept_prefill_after_scoring"] = engine.ledger.prefill_tokens - pre
  res["kept_trees_on_their_pages_shard"] = all(
      all(p // n == engine.tree_state(t).shard for pages in engine.tree_state(t).page_refs
          for p in pages) for t in kept_trees)
  engine.release()
  res["kept_released_all"] = engine.alloc.num_free == free0
  # Rollouts one step ahead on the mesh: started in the idle slots of each shard, adopted by
  # the next run, the single device's tokens, each tree on one shard, nothing leaks.
  step1 = [PromptRequest(p, n=3, uid=10 + i) for i, p in enumerate(PROMPTS[:2])]
  step2 = [PromptRequest(p, n=2, uid=20 + i) for i, p in enumerate(PROMPTS)]
  one = make_engine(model)
  ref = one.run(step1) + one.run(step2)
  free0 = engine.alloc.num_free
  first = engine.run(step1, ahead=step2)
  res["ahead_started"] = engine.ahead_ledger.rollouts_started
  both = first + engine.run([], adopt=True)
  res["ahead_same_tokens"] = leaves(both) == leaves(ref)
  res["ahead_trees_on_one_shard"] = all(
      all(p // n == engine.tree_state(t).shard for pages in engine.tree_state(t).page_refs
          for p in pages) for t in both)
  engine.release()
  res["ahead_released_all"] = engine.alloc.num_free == free0
  # Plain paged attention (no groups) on the mesh: the same tokens too.
  plain = make_engine(model, mesh, use_tree_attention=False)
  res["plain_same_tokens"] = leaves(plain.run([PromptRequest(p, n=2) for p in PROMPTS])) == \
      leaves(make_engine(model).run([PromptRequest(p, n=2) for p in PROMPTS]))
  print(json.dumps(res, default=str))
  return 0


if __name__ == "__main__":
  sys.exit(main())
