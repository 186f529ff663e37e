"""LoRA (`model.lora`, trace_jax/models/lora.py, trace_jax/lora_run.py): a frozen base plus f32
adapters. Zero-initialised B computes the base exactly; merged and unmerged weights agree, also
through an HF export; adapter gradients match finite differences; an update moves the adapters and
the predictor head only; a tiny LoRA run stopped and resumed equals the uninterrupted one and
refuses a resume onto another base."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trace_jax.models import from_pretrained, get_preset, lora, save_pretrained
from trace_jax.models.predictor import PredictorHead
from trace_jax.models.registry import build_model
from trace_jax.rl.update import UpdateConfig, init_train_state, jit_update_step, make_grad_fn

V, B, T, K = 48, 3, 12, 2


PRESETS = {"qwen3": "tiny", "qwen2": "qwen2p5_0p5b", "llama": "llama3p2_1b"}


def _model(family="qwen3", param_dtype="float32", seed=0):
  """A tiny random model of `family` (its smallest preset shrunk): (graphdef, params)."""
  cfg = get_preset(PRESETS[family], vocab_size=V, num_layers=2, hidden_size=64,
                   intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=16,
                   dtype="float32", param_dtype=param_dtype)
  return nnx.split(build_model(cfg, nnx.Rngs(seed)))


def _tokens(seed=0):
  return jnp.asarray(np.random.RandomState(seed).randint(0, V, (B, T)), jnp.int32)


def _noisy(adapters, seed=1, scale=0.05):
  """Adapters with B (and A) moved off their initialization."""
  leaves, tree = jax.tree.flatten(adapters)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [x + scale * jax.random.normal(k, x.shape, x.dtype)
                                   for x, k in zip(leaves, keys)])


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_zero_b_gives_the_base_logits_exactly(param_dtype):
  g, p = _model(param_dtype=param_dtype)
  lg, base, adapters = lora.adapt(g, p, 4, 8.0, "all", seed=3)
  x = _tokens()
  want = nnx.merge(g, p)(x)
  assert jnp.array_equal(nnx.merge(lg, base, adapters)(x), want)
  # the merged weights of zero B are the base's, bit for bit, and the base keeps its dtype
  merged = lora.merged_weights(lg, base, adapters)
  assert all(jnp.array_equal(a, b) and a.dtype == jnp.dtype(param_dtype)
             for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(p)))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(adapters))
  assert not any(jnp.any(b[...]) for path, b in nnx.to_flat_state(adapters) if path[-1] == "b")


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_merged_and_unmerged_logits_agree_and_export(family, tmp_path):
  g, p = _model(family)
  lg, base, adapters = lora.adapt(g, p, 4, 8.0, "q,v,o,down", seed=3)
  adapters = _noisy(adapters)
  x = _tokens()
  unmerged = nnx.merge(lg, base, adapters)(x)
  merged = nnx.merge(g, lora.merged_weights(lg, base, adapters))(x)
  assert float(jnp.max(jnp.abs(unmerged - nnx.merge(g, p)(x)))) > 0.1  # the adapters act
  np.testing.assert_allclose(merged, unmerged, atol=2e-5)
  # export: an HF checkpoint of the merged model reads back as the same policy
  save_pretrained(lora.merged_model(lg, base, adapters), str(tmp_path))
  np.testing.assert_allclose(from_pretrained(str(tmp_path))(x), merged, atol=1e-6)


def test_the_sampler_decodes_the_same_merged_or_unmerged():
  """`model.lora.sampler`: the engine on the plain graph with merged weights, or on the adapted
  graph with base and adapters side by side, decodes the same tokens with the same log-probs."""
  from trace_jax.sampling.engine import PromptRequest, SamplerConfig, SamplerEngine
  from trace_jax.sampling.testing import IdTokenizer, ScriptedEnv

  g, p = _model()
  lg, base, adapters = lora.adapt(g, p, 4, 8.0, "all", seed=3)
  adapters = _noisy(adapters, scale=0.2)
  cfg = SamplerConfig(num_slots=4, page_size=4, num_pages=64, max_seq_len=32, max_turn_tokens=6,
                      prefill_chunk=(8,), page_buckets=(8,), seed=7)
  tok = IdTokenizer()
  trees = {}
  for name, (graph, weights) in {"merged": (g, lora.merged_weights(lg, base, adapters)),
                                 "unmerged": (lg, lora.combined(base, adapters))}.items():
    engine = SamplerEngine(graph, weights, cfg, tok.encode, tok.decode,
                           ScriptedEnv(V, max_depth=1), eos_id=None)
    trees[name] = engine.run([PromptRequest([3, 4, 5, 6], n=3)])[0]
  a, b = trees["merged"].leaves(), trees["unmerged"].leaves()
  assert [x.gen_ids for x in a] == [y.gen_ids for y in b] and len(a) == 3
  np.testing.assert_allclose([x.logprobs for x in a], [y.logprobs for y in b], atol=1e-4)
  base_engine = SamplerEngine(g, p, cfg, tok.encode, tok.decode, ScriptedEnv(V, max_depth=1),
                              eos_id=None)
  plain = base_engine.run([PromptRequest([3, 4, 5, 6], n=3)])[0].leaves()
  assert [x.logprobs for x in plain] != [x.logprobs for x in a]  # the adapters act


def test_adapters_take_their_base_logical_axes():
  from trace_jax.config import LORA_TARGETS

  assert LORA_TARGETS == tuple(lora.TARGETS)  # the knob's doc names what the model accepts
  g, p = _model()
  _, _, adapters = lora.adapt(g, p, 4, 8.0, "all", seed=0)
  attn = adapters["layers"][0]["self_attn"]
  assert attn["q_proj_lora"]["a"].logical_axes == ("embed", "lora_rank")
  assert attn["q_proj_lora"]["b"].logical_axes == ("lora_rank", "heads", "head_dim")
  assert attn["o_proj_lora"]["a"].logical_axes == ("heads", "head_dim", "lora_rank")
  assert attn["o_proj_lora"]["b"].logical_axes == ("lora_rank", "embed")
  mlp = adapters["layers"][1]["mlp"]
  assert mlp["down_proj_lora"]["a"].logical_axes == ("mlp", "lora_rank")
  with pytest.raises(ValueError, match="unknown"):
    lora.parse_targets("q,wq")


def _batch(seed=0):
  rs = np.random.RandomState(seed)
  mask = (rs.rand(B, T) < 0.7).astype(np.float32)
  mask[:, 0] = 0
  return {"tokens": np.asarray(_tokens(seed)), "segment_ids": np.ones((B, T), np.int32),
          "positions": np.tile(np.arange(T, dtype=np.int32), (B, 1)), "mask": mask,
          "adv": rs.randn(B, T).astype(np.float32),
          "old_logp": np.full((B, T), -3.8, np.float32), "ref_logp": np.zeros((B, T), np.float32),
          "pred_pos": rs.randint(0, T, (B, K)).astype(np.int32),
          "pred_target": rs.rand(B, K).astype(np.float32),
          "pred_weight": np.ones((B, K), np.float32)}


@functools.cache
def _lora_setup():
  g, p = _model()
  lg, base, adapters = lora.adapt(g, p, 2, 4.0, "all", seed=5)
  hg, hp = nnx.split(PredictorHead(64, 16, rngs=nnx.Rngs(1)))
  return lg, hg, base, adapters, hp


def test_adapter_gradients_match_finite_differences():
  cfg = UpdateConfig(lr=1e-3, eps_low=10.0, eps_high=10.0)  # no clipping: a smooth loss
  lg, hg, base, adapters, hp = _lora_setup()
  state = init_train_state(_noisy(adapters, scale=0.1), hp, cfg)
  grads = jax.jit(make_grad_fn(lg, hg, cfg))
  batch = _batch()
  loss, _, (gp, _) = grads(state, batch, base)
  flat, tree = jax.tree.flatten(state["params"])
  gflat = jax.tree.leaves(gp)
  assert len(gflat) == len(flat) and all(g.dtype == jnp.float32 for g in gflat)
  rs = np.random.RandomState(0)
  for i in rs.choice(len(flat), 4, replace=False):  # random directions in single adapters
    u = jnp.asarray(rs.randn(*flat[i].shape), jnp.float32)
    u = u / jnp.linalg.norm(u)
    eps = 1e-2

    def at(s):
      moved = flat[:i] + [flat[i] + s * eps * u] + flat[i + 1:]
      return float(grads(dict(state, params=jax.tree.unflatten(tree, moved)), batch, base)[0])
    fd = (at(1) - at(-1)) / (2 * eps)
    an = float(jnp.vdot(gflat[i], u))
    assert abs(fd - an) <= 2e-3 + 2e-2 * abs(an), (i, fd, an)
  assert float(loss) == float(loss)  # finite


def test_an_update_changes_the_adapters_and_the_head_only():
  cfg = UpdateConfig(lr=1e-2)
  lg, hg, base, adapters, hp = _lora_setup()
  base_before = [np.array(x) for x in jax.tree.leaves(base)]
  state = init_train_state(adapters, hp, cfg)
  a0 = [np.array(x) for x in jax.tree.leaves(state["params"])]
  h0 = [np.array(x) for x in jax.tree.leaves(state["pred_params"])]
  # the train state holds the adapters and their f32 moments, nothing of the base's size
  assert sum(x.size for x in jax.tree.leaves(state["opt"])) < sum(x.size for x in base_before)
  step = jit_update_step(lg, hg, cfg, lora=True)
  new, m = step(state, _batch(), base)
  assert m["skipped"] == 0 and float(m["grad_norm"]) > 0
  # With B = 0 the first step moves every B and no A (dL/dA = x^T dy B^T); the second moves both.
  moved = [not np.array_equal(a, np.asarray(b)) for a, b in zip(a0, jax.tree.leaves(new["params"]))]
  names = [path[-1] for path, _ in nnx.to_flat_state(adapters)]
  assert moved == [n == "b" for n in names]
  new, m = step(new, _batch(1), base)
  assert m["skipped"] == 0
  assert all(not np.array_equal(a, np.asarray(b))
             for a, b in zip(a0, jax.tree.leaves(new["params"])))
  assert all(np.array_equal(a, np.asarray(b)) and a.dtype == b.dtype
             for a, b in zip(base_before, jax.tree.leaves(base)))
  assert any(not np.array_equal(a, np.asarray(b))
             for a, b in zip(h0, jax.tree.leaves(new["pred_params"])))


def test_fingerprint_names_the_exact_weights():
  g, p = _model()
  f = lora.fingerprint(p)
  assert f == lora.fingerprint(jax.tree.map(jnp.copy, p))
  w = p["layers"][1]["mlp"]["up_proj"]
  bumped = jax.tree.map(lambda x: x, p)
  bumped["layers"][1]["mlp"]["up_proj"] = w.replace(w[...].at[3, 5].add(1e-6))
  assert lora.fingerprint(bumped) != f


# ---- a tiny LoRA training run: exact resume, and a resume onto another base refused ------------
def _lora_run_config(tmp_path):
  from configs import mhqa

  c = mhqa.get_config("smoke")
  c.workdir, c.world.cache_dir = str(tmp_path / "run"), str(tmp_path / "cache")
  c.sft.steps, c.sft.num_traces = 2, 64
  c.rollout.prompts_per_step, c.rollout.candidate_prompts = 2, 3
  c.rollout.root_budget, c.rollout.prefix_budget = 4, 2
  c.rollout.num_slots, c.rollout.num_pages = 4, 256
  c.rl.train_rows, c.rl.predictor_fit_steps, c.rl.kl_coef = 4, 5, 0.1
  c.model.lora.rank, c.model.lora.targets = 4, "q,v,up"
  return mhqa.validate(c)


def _advantages(step, batch):
  """Random advantages (the smoke policy rarely succeeds: every group unmixed, every advantage
  zero), drawn from the step alone so that a resumed step draws the same."""
  rs = np.random.RandomState(step)
  return dict(batch, adv=rs.randn(*batch["adv"].shape).astype(np.float32))


def test_a_lora_run_resumes_exactly_and_refuses_another_base(tmp_path):
  from trace_jax import train as T
  from trace_jax.checkpoint import restore_run_policy
  from trace_jax.run_state import Hooks

  c = _lora_run_config(tmp_path)
  run = T.build(c, Hooks(batch=_advantages))
  assert run.lora is not None and run.ref_params is run.lora.base  # the KL reference: no copy
  timing = ("seconds",)

  def step(state):
    sample, rec = T.sample_step(run, state)
    state, rec = T.update_step(run, state, sample, rec)
    return state, {k: v for k, v in rec.items() if not any(t in k for t in timing)}

  s1, _ = step(T.init_state(run))
  T.save(run, s1)
  s2, rec2 = step(s1)
  assert rec2["skipped_steps"] == 0 and rec2["grad_norm"] > 0
  r1 = T.restore(run)
  assert r1.step == 1
  policy1 = lora.merged_weights(run.lora.graphdef, run.lora.base, r1.train["params"])
  r2, rec2b = step(r1)
  assert json.dumps(rec2b, sort_keys=True) == json.dumps(rec2, sort_keys=True)  # NaN == NaN
  for part in ("params", "pred_params", "opt"):
    a, b = jax.tree.leaves(s2.train[part]), jax.tree.leaves(r2.train[part])
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b)), part
  # the checkpoint holds the adapters and the head (not the base), and the base's fingerprint
  meta = run.ckpt.metadata()
  assert meta["lora"]["base_fingerprint"] == run.lora.fingerprint
  assert meta["lora"]["rank"] == 4 and meta["lora"]["targets"] == "q,v,up"
  assert {p[-1] for p, _ in nnx.to_flat_state(s1.train["params"])} == {"a", "b"}
  # the evaluation's reader: the checkpoint's adapters merged into the base it is given
  got, at = restore_run_policy(c, c.workdir, 1, run.graphdef, run.lora.base)
  assert at == 1 and all(np.array_equal(x, y) for x, y in
                         zip(jax.tree.leaves(got), jax.tree.leaves(policy1)))
  # another base: refused with a clear error
  other = jax.tree.map(lambda x: x * 1.5, run.lora.base)
  with pytest.raises(ValueError, match="adapters trained on another base"):
    restore_run_policy(c, c.workdir, 1, run.graphdef, other)
  run.lora = dataclasses.replace(run.lora, fingerprint="0" * 16)
  with pytest.raises(ValueError, match="adapters trained on another base"):
    T.restore(run)
