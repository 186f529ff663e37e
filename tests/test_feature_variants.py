"""The feature variants the predictor head could read (`trace_jax.diagnostics.feature_variants`):
the teacher-forced last-token state is what the sampler's feature step computes, the means cover
the right spans, and the concatenations stack their parts."""

import numpy as np
from flax import nnx

from trace_jax.diagnostics import FEATURE_VARIANTS, feature_variants
from trace_jax.models.qwen3 import Qwen3, get_preset
from trace_jax.sampling.engine_ops import make_feature_step
from trace_jax.sampling.tree import Tree

V = 64


def _trees():
  rng = np.random.default_rng(0)
  trees = []
  for k in range(3):
    t = Tree(rng.integers(1, V, 5 + 3 * k).tolist(), uid=k)
    a = t.add_node(0, gen_ids=rng.integers(1, V, 4).tolist(), obs_ids=[7, 8, 9])
    t.add_node(a.id, gen_ids=rng.integers(1, V, 6).tolist(), done=True, reward=1.0)
    t.add_node(0, gen_ids=rng.integers(1, V, 2).tolist(), done=True, reward=0.0)
    for n in t.nodes:
      n.feature = np.zeros((4,), np.float32)
    t.nodes[-1].feature = None  # a leaf whose feature was not recorded: skipped
    trees.append(t)
  return trees


def test_feature_variants_match_the_sampler_feature_and_their_spans():
  gd, st = nnx.split(Qwen3(get_preset("tiny", vocab_size=V), rngs=nnx.Rngs(0)))
  trees = _trees()
  out = feature_variants(gd, st, trees, batch=4, bucket=8)
  assert set(out) == set(FEATURE_VARIANTS)
  keys = {(ti, n.id) for ti, t in enumerate(trees) for n in t.nodes if n.feature is not None}
  assert all(set(out[v]) == keys for v in FEATURE_VARIANTS) and len(keys) == 9
  model = nnx.merge(gd, st)
  d = model.cfg.hidden_size
  # The sampler's feature step over all prefixes at once (right padded), and one plain forward per
  # tree over its deepest path: with causal attention, each prefix's states are its first rows.
  order = sorted(keys)
  seqs = [trees[ti].path_tokens(nid)[0] for ti, nid in order]
  pad = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
  for r, q in enumerate(seqs):
    pad[r, :len(q)] = q
  ref = np.asarray(make_feature_step(gd)(st, pad, np.asarray([len(q) for q in seqs], np.int32)))
  chains = {ti: np.asarray(model.forward(t.path_tokens(2)[0][None])["hidden"][0], np.float32)
            for ti, t in enumerate(trees)}
  for r, (ti, nid) in enumerate(order):
    np.testing.assert_allclose(out["final_last"][(ti, nid)], ref[r], rtol=1e-5, atol=1e-5)
    final = chains[ti][:len(seqs[r])]
    np.testing.assert_allclose(out["final_mean"][(ti, nid)], final.mean(0), rtol=1e-4, atol=1e-5)
    plen = len(trees[ti].prompt_ids)
    np.testing.assert_allclose(out["prompt_mean"][(ti, nid)], final[:plen].mean(0), rtol=1e-4,
                               atol=1e-5)
    assert out["mid_last"][(ti, nid)].shape == (d,)
    assert not np.allclose(out["mid_last"][(ti, nid)], out["final_last"][(ti, nid)])
    both = out["final_last+prompt_mean"][(ti, nid)]
    assert both.shape == (2 * d,)
    np.testing.assert_array_equal(both[d:], out["prompt_mean"][(ti, nid)])
  # every node of one tree shares the prompt mean; the root's prefix is the prompt
  np.testing.assert_allclose(out["prompt_mean"][(0, 0)], out["prompt_mean"][(0, 2)], atol=1e-5)
  np.testing.assert_allclose(out["prompt_mean"][(1, 0)], out["final_mean"][(1, 0)], atol=1e-5)


# ---- the "last+prompt_mean" predictor features, wired (model.predictor_features) ----------------
def test_sampler_and_update_compute_the_same_prompt_mean_features():
  """With `prompt_mean_features`, every node's feature is [its last state, its prompt's mean final
  state] as a teacher-forced forward computes it; prompt scoring gives the root's; and the update
  recomputes the same features from a packed batch of the trees (`span_means` per segment)."""
  import jax
  import jax.numpy as jnp

  from trace_jax.rl.batch import build_sequences, pack_batch
  from trace_jax.rl.update import span_means
  from trace_jax.sampling.engine import ForkRequest, PromptRequest, SamplerConfig, SamplerEngine
  from trace_jax.sampling.testing import IdTokenizer, ScriptedEnv

  gd, st = nnx.split(Qwen3(get_preset("tiny", vocab_size=V), rngs=nnx.Rngs(0)))
  st = jax.tree.map(lambda x: x * 6.0, st)
  tok = IdTokenizer({5: "</search>", 6: "</answer>"})
  cfg = SamplerConfig(num_slots=4, page_size=4, num_pages=512, max_seq_len=96, max_turn_tokens=7,
                      max_obs_tokens=12, max_turns=4, prefill_chunk=(16,), page_buckets=(24,),
                      greedy=True, max_group_size=2, max_groups=2, prompt_mean_features=True)
  engine = SamplerEngine(gd, st, cfg, tok.encode, tok.decode, ScriptedEnv(V), eos_id=1)
  prompts = [[3, 9, 12, 17, 22, 30, 41], [10, 11, 12], list(range(20, 38))]
  trees = engine.run([PromptRequest(p, n=2) for p in prompts])
  engine.run([ForkRequest(t, a.id, 2) for t in trees for a in t.anchors() if a.depth == 1])
  d = engine.model_cfg.hidden_size
  ref = feature_variants(gd, st, trees)["final_last+prompt_mean"]
  assert len(ref) == sum(len(t.nodes) for t in trees) > 12
  for (ti, nid), f in ref.items():
    got = trees[ti].nodes[nid].feature
    assert got.shape == (2 * d,)
    np.testing.assert_allclose(got, f, rtol=1e-4, atol=1e-4)
  scored = engine.prompt_features(prompts)
  np.testing.assert_allclose(scored, np.stack([t.root.feature for t in trees]), atol=1e-4)
  # The update's features: packed rows of several sequences each, prompts found per segment.
  seqs, _, _ = build_sequences(trees, "tree_contrastive", 4)
  batch, info = pack_batch(seqs, row_len=96, preds_per_row=16, row_multiple=1)
  assert max(np.bincount(batch["segment_ids"][r][batch["segment_ids"][r] > 0]).size - 1
             for r in range(batch["tokens"].shape[0])) >= 2  # some row holds 2+ sequences
  hidden = nnx.merge(gd, st).forward(jnp.asarray(batch["tokens"]),
                                     positions=jnp.asarray(batch["positions"]),
                                     segment_ids=jnp.asarray(batch["segment_ids"]))["hidden"]
  last = np.take_along_axis(np.asarray(hidden, np.float32), batch["pred_pos"][..., None], axis=1)
  feats = np.concatenate([last, np.asarray(span_means(hidden, jnp.asarray(batch["pred_pstart"]),
                                                      jnp.asarray(batch["pred_plen"])))], -1)
  nodes = np.stack([n.feature for t in trees for n in t.nodes])
  used = batch["pred_weight"] > 0
  assert used.sum() > 12
  for f in feats[used]:  # each trained prediction reads some node's recorded feature
    assert np.abs(nodes - f).max(axis=1).min() < 1e-3


def test_a_run_checkpoint_restores_with_the_head_width_it_was_trained_with():
  """`launch/eval.py` and the probe rebuild the train state a checkpoint holds
  (`checkpoint.restore_target`); with the prompt mean the head reads 2 x hidden features, so the
  target must be that wide (it was hidden-wide, and a prompt-mean run's checkpoint failed to
  restore)."""

  import jax
  import pytest

  from configs import mhqa
  from trace_jax.checkpoint import restore_target
  from trace_jax.models.predictor import feature_width
  gd, st = nnx.split(Qwen3(get_preset("tiny", vocab_size=V), rngs=nnx.Rngs(0)))
  d = nnx.merge(gd, st).cfg.hidden_size
  for features, width in (("last", d), ("last+prompt_mean", 2 * d)):
    c = mhqa.get_config()
    c.model.predictor_features = features
    target = restore_target(c, gd, st)
    shapes = {a.shape for a in jax.tree.leaves(target["pred_params"])}
    assert (width, c.model.predictor_hidden) in shapes and (width,) in shapes, (features, shapes)
    assert feature_width(d, features) == width
  with pytest.raises(ValueError, match="predictor_features"):
    feature_width(d, "mean")
