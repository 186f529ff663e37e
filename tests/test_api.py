"""The public API: lazy top-level exports, the README's list of them, docstring examples,
jit/vmap."""

import doctest
import functools
import importlib
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import trace_jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme_api_names():
  """Names in the first column of the tables under README's "Use in your own project"."""
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    text = f.read()
  match = re.search(r"^## Use in your own project\n(.*?)(?=^## |\Z)", text,
                    re.MULTILINE | re.DOTALL)
  assert match, "README.md has no section '## Use in your own project'"
  return re.findall(r"^\| `([A-Za-z_][A-Za-z0-9_]*)` \|", match.group(1), re.MULTILINE)


def test_import_is_lazy():
  code = ("import sys, trace_jax; heavy = [m for m in ('jax', 'flax', 'numpy', 'optax') "
          "if m in sys.modules]; assert not heavy, heavy; print(len(trace_jax.__all__))")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=False)
  assert out.returncode == 0, out.stderr
  assert int(out.stdout) == len(trace_jax.__all__) >= 25


def test_exports_resolve_to_their_modules():
  assert set(trace_jax.__all__) <= set(dir(trace_jax))
  for name in trace_jax.__all__:
    obj = getattr(trace_jax, name)
    assert obj is getattr(importlib.import_module(trace_jax._EXPORTS[name]), name)
  from trace_jax import SamplerEngine, allocate_roots, tree_attention  # noqa: F401
  assert callable(tree_attention) and tree_attention.__name__ == "tree_attention"
  with pytest.raises(AttributeError, match="no_such_name"):
    trace_jax.no_such_name  # noqa: B018


def test_readme_section_matches_exports():
  names = _readme_api_names()
  assert len(names) == len(set(names)), "a name is listed twice"
  assert set(names) == set(trace_jax.__all__)
  module = __import__("trace_jax", fromlist=names)  # `from trace_jax import <names>`
  assert all(getattr(module, n) is getattr(trace_jax, n) for n in names)


def _example_globals():
  g = {"jax": jax, "jnp": jnp, "np": np, "nnx": nnx, "os": os, "tempfile": tempfile}
  g.update({n: getattr(trace_jax, n) for n in trace_jax.__all__})
  return g


@pytest.mark.parametrize("name", trace_jax.__all__)
def test_docstring_example_runs(name):
  doc = getattr(trace_jax, name).__doc__ or ""
  test = doctest.DocTestParser().get_doctest(doc, _example_globals(), name, None, 0)
  assert test.examples, f"{name} has no example in its docstring"
  assert any(ex.want for ex in test.examples), f"{name}'s example checks no value"
  report = []
  runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
  with tempfile.TemporaryDirectory() as tmp:
    cwd = os.getcwd()
    os.chdir(tmp)
    try:
      result = runner.run(test, out=report.append)
    finally:
      os.chdir(cwd)
  assert result.failed == 0, "".join(report)


# ---- the pure functions under jit and vmap --------------------------------------------------


def _rows(fn, *batched, **kw):
  """fn applied to each row of the batched arguments, stacked (pytree outputs alike)."""
  one = jax.jit(functools.partial(fn, **kw))  # compiled once: eager dispatch is slow on CPU
  outs = [one(*(a[i] for a in batched)) for i in range(batched[0].shape[0])]
  return jax.tree.map(lambda *x: jnp.stack(x), *outs)


def _assert_same(a, b, atol=1e-6):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol),
               a, b)


def test_allocators_jit_and_vmap():
  from trace_jax import allocate_prefixes, allocate_prefixes_tree_aware, allocate_roots
  from trace_jax import allocate_roots_subset, root_value
  p = jax.random.uniform(jax.random.key(0), (4, 6))
  roots = functools.partial(allocate_roots, budget=20, min_per_prompt=2, max_per_prompt=6)
  m = jax.jit(jax.vmap(roots))(p)
  _assert_same(m, _rows(roots, p))
  assert np.all(np.asarray(m).sum(1) == 20) and np.asarray(m).min() >= 2
  subset = functools.partial(allocate_roots_subset, budget=8, num_selected=2)
  _assert_same(jax.jit(jax.vmap(subset))(p), _rows(subset, p))
  _assert_same(jax.jit(jax.vmap(root_value))(p, m), _rows(root_value, p, m))

  outcomes = (jax.random.uniform(jax.random.key(1), (4, 6)) > 0.5).astype(jnp.float32)
  costs = jax.random.uniform(jax.random.key(2), (4, 6), minval=1.0, maxval=5.0)
  valid = jnp.arange(6)[None].repeat(4, 0) < jnp.array([[6], [5], [3], [1]])
  budget = jnp.array([4, 5, 6, 7])  # a traced, per-row budget
  summed = functools.partial(allocate_prefixes, max_per_anchor=3)
  k = jax.jit(jax.vmap(summed))(p, outcomes, costs, budget, valid)
  _assert_same(k, _rows(summed, p, outcomes, costs, budget, valid))
  assert np.all(np.asarray(k)[~np.asarray(valid)] == 0)
  tree = jnp.array([0, 0, 1, 1, 2, 2])[None].repeat(4, 0)
  mixed = jnp.array([[False, True, False]]).repeat(4, 0)
  aware = functools.partial(allocate_prefixes_tree_aware, max_per_anchor=3, lam=0.1)
  args = (p, outcomes, costs, tree, mixed, budget, valid)
  _assert_same(jax.jit(jax.vmap(aware))(*args), _rows(aware, *args))


def _forests(b=3, n=9):
  """b random forests of n nodes in one flat layout each: two trees, random parents and rewards."""
  rng = np.random.default_rng(0)
  parent, tree = np.full((b, n), -1), np.zeros((b, n), np.int32)
  for i in range(b):
    roots = [0, 1]
    tree[i, :2] = [0, 1]
    for j in range(2, n):
      parent[i, j] = rng.integers(0, j) if j > 2 else rng.choice(roots)
      tree[i, j] = tree[i, parent[i, j]]
  has_child = np.zeros((b, n), bool)
  for i in range(b):
    has_child[i, parent[i][parent[i] >= 0]] = True
  is_leaf = ~has_child & (parent >= 0)
  reward = rng.integers(0, 2, (b, n)).astype(np.float32)
  return (jnp.asarray(parent), jnp.asarray(is_leaf), jnp.asarray(reward), jnp.asarray(tree),
          jnp.ones((b, n), bool))


@pytest.mark.parametrize("name", ["tree_contrastive_advantages", "grpo_advantages",
                                  "tree_grpo_advantages", "treerl_advantages"])
def test_advantages_jit_and_vmap(name):
  fn = functools.partial(getattr(trace_jax, name), max_depth=8)
  forests = _forests()
  adv = jax.jit(jax.vmap(fn))(*forests)
  _assert_same(adv, _rows(fn, *forests), atol=1e-5)
  assert np.abs(np.asarray(adv)).max() > 0.1  # real contrast, not an all-zero output


def test_backup_ownership_and_token_advantages_jit_and_vmap():
  from trace_jax import backup_values, ownership_mask, token_advantages
  parent, is_leaf, reward, _, valid = _forests()
  backup = functools.partial(backup_values, max_depth=8)
  _assert_same(jax.jit(jax.vmap(backup))(parent, is_leaf, reward, valid),
               _rows(backup, parent, is_leaf, reward, valid))
  ids = jnp.array([[[-1, 1, 1, 3], [-1, 1, 2, 4]], [[-1, 2, 2, 5], [-1, 2, 2, 5]]])
  for own in (ownership_mask, functools.partial(ownership_mask, num_nodes=6)):
    _assert_same(jax.jit(jax.vmap(own))(ids), _rows(own, ids))
  node_adv = jnp.arange(12, dtype=jnp.float32).reshape(2, 6)
  _assert_same(jax.jit(jax.vmap(token_advantages))(node_adv, ids),
               _rows(token_advantages, node_adv, ids))


def test_losses_jit_vmap_and_grad():
  from trace_jax import ppo_clip_loss, token_logprobs_and_entropy
  keys = jax.random.split(jax.random.key(3), 4)
  logits = jax.random.normal(keys[0], (3, 2, 5, 7))
  targets = jax.random.randint(keys[1], (3, 2, 5), 0, 7)
  logprobs = functools.partial(token_logprobs_and_entropy, temperature=0.8)
  logp, ent = jax.jit(jax.vmap(logprobs))(logits, targets)
  _assert_same((logp, ent), _rows(logprobs, logits, targets), atol=1e-5)
  logp_old = logp + 0.3 * jax.random.normal(keys[2], logp.shape)
  adv = jax.random.normal(keys[3], logp.shape)
  mask = jnp.ones_like(logp).at[:, :, -1].set(0.0)

  def loss(lp, lo, a, m):
    return ppo_clip_loss(lp, lo, a, m, ref_logp=lo, kl_coef=0.1)[0]

  _assert_same(jax.jit(jax.vmap(loss))(logp, logp_old, adv, mask),
               _rows(loss, logp, logp_old, adv, mask), atol=1e-5)
  grad = jax.jit(jax.grad(loss))(logp[0], logp_old[0], adv[0], mask[0])
  assert np.all(np.asarray(grad)[:, -1] == 0) and np.abs(np.asarray(grad)).max() > 0


@pytest.mark.parametrize("name", ["tree_attention", "tree_attention_reference"])
def test_tree_attention_jit_and_vmap(name):
  """vmap over a leading layer axis of the queries and the pools; the page tables are shared."""
  fn = getattr(trace_jax, name)
  kq, kk, kv = jax.random.split(jax.random.key(4), 3)
  q = jax.random.normal(kq, (2, 3, 4, 16))  # [L, S, Hq, D]
  k = jax.random.normal(kk, (2, 10, 4, 2, 16))  # [L, pages, page_size, Hkv, D]
  v = jax.random.normal(kv, (2, 10, 4, 2, 16))
  tables = (jnp.array([[1, 2], [5, 0]]), jnp.array([7, 3]), jnp.array([[0, 1], [2, -1]]),
            jnp.array([[3, 0], [4, 0], [6, 7]]), jnp.array([2, 4, 5]))
  per_layer = functools.partial(fn, **dict(zip(("group_pages", "group_lens", "group_slots",
                                                "suffix_pages", "suffix_lens"), tables)))
  out = jax.jit(jax.vmap(per_layer))(q, k, v)
  _assert_same(out, _rows(per_layer, q, k, v), atol=1e-5)
  # Slots 0 and 1 share 7 prefix tokens on pages 1, 2 (page 2 is not full, so the flat tables
  # cannot hold their suffixes after it): compare with the prefix alone, suffixes empty.
  from trace_jax.kernels import paged_attention_reference
  no_suffix = jax.jit(per_layer)(q[0], k[0], v[0], suffix_lens=jnp.array([0, 0, 5]))
  flat = paged_attention_reference(q[0], k[0], v[0], jnp.array([[1, 2], [1, 2], [0, 0]]),
                                   jnp.array([7, 7, 0]))
  _assert_same(no_suffix[:2], flat[:2], atol=1e-5)


def test_predictor_under_jit_and_vmap():
  from trace_jax import PredictorHead
  from trace_jax.models.predictor import predict_probs
  head = PredictorHead(16, hidden=8, rngs=nnx.Rngs(0))
  gd, st = nnx.split(head)
  feats = jax.random.normal(jax.random.key(5), (3, 4, 16))
  p = jax.jit(jax.vmap(predict_probs, in_axes=(None, None, 0)), static_argnums=0)(gd, st, feats)
  _assert_same(p, head.prob(feats), atol=1e-6)
  assert p.shape == (3, 4) and float(p.min()) > 0 and float(p.max()) < 1
