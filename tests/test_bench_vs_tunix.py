"""`benchmarks/bench_vs_tunix.py` helpers that need no Tunix: the FLOP count behind its MFU numbers,
the multi-turn tree workload's token count (checked against our engine running that workload) and
the ratio summary."""

import importlib.util
import os

import jax
import numpy as np
import pytest
from flax import nnx

from trace_jax.models.qwen3 import Qwen3, Qwen3Config
from trace_jax.sampling.engine import PromptRequest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("bench_vs_tunix",
                                               os.path.join(ROOT, "benchmarks",
                                                            "bench_vs_tunix.py"))
bvt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bvt)


def _size(model):
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model)))


@pytest.mark.parametrize("tied", [True, False])
def test_matmul_params_match_the_model(tied):
  cfg = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=tied)
  total = _size(Qwen3(cfg, rngs=nnx.Rngs(0)))
  # Every weight but the input embedding (which the tied LM head reuses) is multiplied per token.
  assert bvt.matmul_params(cfg) == total - (0 if tied else 96 * 32)
  assert bvt.decode_flops_per_token(cfg) == 2 * bvt.matmul_params(cfg)


def test_tree_plan_counts_what_our_engine_generates():
  plan = bvt.tree_plan(prompts=2, rollouts=2, turns=3, forks=2, turn_tokens=4, obs_tokens=3,
                       prompt_len=10)
  # Stage 1: 4 rollouts x 3 turns; forks: 8 branches x 2 turns.
  assert plan["tunix_batches"] == [(4, 10), (4, 17), (4, 24), (8, 17), (8, 24)]
  assert plan["generated_tokens"] == (12 + 16) * 4
  cfg = Qwen3Config(vocab_size=bvt.VOCAB, hidden_size=32, intermediate_size=64, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=16, tie_word_embeddings=True)
  graphdef, state = nnx.split(Qwen3(cfg, rngs=nnx.Rngs(0)))
  engine = bvt.our_engine(graphdef, state, slots=8, max_seq_len=48, turn_tokens=4, turns=3,
                          prefill_chunk=16, prefill_rows=2, decode_steps=4,
                          env=bvt.TreeEnv(3, 3), obs_tokens=3, group=2,
                          page_buckets=(3,))  # one page-table width: one decode compilation
  rng = np.random.default_rng(0)
  trees = engine.run([PromptRequest(list(rng.integers(8, bvt.VOCAB, 10)), n=2) for _ in range(2)])
  engine.run([(t, n.id, 2) for t in trees for n in t.nodes if n.depth == 1])
  assert engine.ledger.generated_tokens == plan["generated_tokens"]
  # The observations are the workload's deterministic function of each turn's tokens.
  node = next(n for n in trees[0].nodes if n.depth == 1)
  assert node.obs_ids == bvt.observation(node.gen_ids, 1, 3)


def test_summarize_medians_and_ratio():
  out = bvt.summarize([10.0, 30.0, 20.0], [5.0, 4.0, 8.0])
  assert out == {"ours_tok_s": 20.0, "tunix_tok_s": 5.0, "ratio_ours_over_tunix": 4.0,
                 "round_ratios": [2.0, 7.5, 2.5], "median_round_ratio": 2.5}
