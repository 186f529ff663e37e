"""Warm-start packing and training, the memory plan, and the sampler-environment bridge."""

import numpy as np
import pytest
from flax import nnx

from trace_jax.envs.tasks.multihop import MultiHopEnv
from trace_jax.envs.types import Doc
from trace_jax.models.qwen3 import Qwen3, get_preset
from trace_jax.plan import plan_memory
from trace_jax.rl.batch import build_sequences
from trace_jax.envs.adapter import TreeEnvAdapter
from trace_jax.sampling.engine import TurnRef
from trace_jax.sampling.tree import Tree
from trace_jax.sft import SFTConfig, encode_segments, pack_sequences, sft_train, target_positions


def _enc(text):
  return [len(w) for w in text.split()]


def test_encode_and_pack_keep_every_token_and_mask():
  segs = [[("a bb", False), ("ccc dddd", True), ("e", False)], [("ff", False), ("g hh", True)]]
  seqs = [encode_segments(_enc, s, bos_id=1) for s in segs]
  assert seqs[0][0].tolist() == [1, 1, 2, 3, 4, 1]
  assert seqs[0][1].tolist() == [False, False, False, True, True, False]
  packed = pack_sequences(seqs * 3, row_len=8)
  assert packed["tokens"].shape[1] == 8
  # every sequence appears once per copy, positions restart per segment
  got = []
  for r in range(packed["tokens"].shape[0]):
    for s in set(packed["segment_ids"][r]) - {0}:
      m = packed["segment_ids"][r] == s
      assert packed["positions"][r][m].tolist() == list(range(m.sum()))
      got.append(packed["tokens"][r][m].tolist())
  assert sorted(got) == sorted([q[0].tolist() for q in seqs] * 3)
  tp = target_positions(packed, max_targets=4)
  # trained targets are exactly the generated tokens, never the first token of a segment
  assert tp["target_w"].sum() == 3 * (2 + 2)
  for r in range(tp["target_pos"].shape[0]):
    for p, w in zip(tp["target_pos"][r], tp["target_w"][r]):
      if w:
        assert packed["loss_mask"][r, p + 1] == 1
        assert packed["segment_ids"][r, p + 1] == packed["segment_ids"][r, p]


def test_sft_learns_a_copy_task():
  rs = np.random.RandomState(0)
  seqs = []
  for _ in range(64):
    x = rs.randint(4, 30, 3).tolist()
    ids = np.asarray([1] + x + [2] + x, np.int32)  # copy the three tokens after the separator
    seqs.append((ids, np.r_[np.zeros(5, bool), np.ones(3, bool)]))
  packed = target_positions(pack_sequences(seqs, 32), 16)
  g, p = nnx.split(Qwen3(get_preset("tiny", vocab_size=32, num_layers=2), rngs=nnx.Rngs(0)))
  _, hist = sft_train(g, p, packed, SFTConfig(steps=60, batch_rows=8, lr=3e-3, warmup=5))
  assert hist[-1]["nll"] < hist[0]["nll"] - 1.0


def test_plan_memory_shards_params_and_optimizer():
  cfg = get_preset("qwen3_14b", dtype="bfloat16", param_dtype="bfloat16")
  one = plan_memory(cfg, "data:1,fsdp:1,tensor:1", num_pages=1024, page_size=64,
                    micro_batch_seqs=8, seq_len=1024)
  many = plan_memory(cfg, "data:1,fsdp:4,tensor:8", num_pages=1024, page_size=64,
                     micro_batch_seqs=8, seq_len=1024)
  assert 29 < one.params_gb < 30.5 and abs(one.optimizer_gb - 4 * one.params_gb) < 1e-6
  assert abs(many.params_gb - one.params_gb / 32) < 0.05  # every large matrix splits 32 ways
  assert many.kv_pool_gb == pytest.approx(one.kv_pool_gb / 8)
  with pytest.raises(ValueError, match="explicit mesh sizes"):
    plan_memory(cfg, "data:-1", num_pages=1, page_size=1, micro_batch_seqs=1, seq_len=1)


class _Docs:
  def search(self, queries, k):
    return [[Doc(id=q, title=q, text=f"{q} is here .")] for q in queries]


def test_env_adapter_carries_turn_count_and_format_flags_into_forks():
  env = MultiHopEnv(_Docs(), "em_format", max_turns=3, topk=1)
  step = TreeEnvAdapter(env)
  tree = Tree([1, 2], uid=7, meta={"answers": ["Paris"]})

  def turn(parent, text):
    node = tree.add_node(parent, text=text)
    (obs, done, r), = step([(TurnRef(tree, node), text)])
    return node, obs, done, r

  bad, obs, done, _ = turn(0, "no action here")
  assert not done and obs  # a corrective observation, the turn counts
  good, obs, done, _ = turn(bad.id, "<search> Paris </search>")
  assert not done and "Paris is here" in obs
  # correct, but an invalid turn came earlier on this path: the format bonus is withheld
  _, obs, done, r = turn(good.id, "<answer> Paris </answer>")
  assert done and obs is None and 0.5 < r < 1.0
  # a fork from the first turn boundary continues from that state (turn 1, one invalid action)
  _, _, done, r = turn(bad.id, "<answer> Paris </answer>")
  assert done and 0.5 < r < 1.0
  # the turn limit counts the earlier turns of the path: turn 3 without an answer ends at 0
  _, obs, done, r = turn(good.id, "<search> again </search>")
  assert done and r == 0.0
  step.release([tree])
  assert not step.states


def test_empty_batch_after_filtering_is_defined():
  seqs, flat, adv = build_sequences([], "tree_contrastive", max_depth=4)
  assert seqs == [] and adv.shape == (0,)
  from test_batch import hand_tree
  _, full, _ = build_sequences([hand_tree()], "tree_contrastive", max_depth=4)
  assert set(flat) == set(full) and all(np.shape(v) == (0,) for v in flat.values())
