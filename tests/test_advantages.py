"""Tests for tree values, advantages and the ownership mask on random flat forests."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from trace_jax.rl import advantages as adv

_N = 16
_MAX_DEPTH = 4
_EPS = 1e-6
_SETTINGS = settings(deadline=None, max_examples=40, derandomize=True)
_seeds = st.integers(0, 2**31 - 1)


def _forest(seed, branching=True, fractional=False, agree=False):
  """A random forest of N nodes (the tail padded), parents before children, depth <= _MAX_DEPTH."""
  rng = np.random.default_rng(seed)
  n_valid = int(rng.integers(1, _N + 1))
  parent = np.full(_N, -1, np.int32)
  tree = np.zeros(_N, np.int32)
  depth = np.zeros(_N, np.int32)
  num_trees = 0
  children = np.zeros(_N, np.int32)
  for i in range(n_valid):
    # Without branching only roots and the tip of a chain (a node without children) can be extended.
    ok = [j for j in range(i) if depth[j] < _MAX_DEPTH and (branching or parent[j] < 0
                                                           or children[j] == 0)]
    if i == 0 or not ok or rng.random() < 0.2:
      tree[i], num_trees = num_trees, num_trees + 1
      continue
    j = int(rng.choice(ok))
    parent[i], tree[i], depth[i] = j, tree[j], depth[j] + 1
    children[j] += 1
  valid = np.arange(_N) < n_valid
  is_leaf = valid & (parent >= 0) & (children == 0)
  reward = rng.random(_N) if fractional else rng.integers(0, 2, _N).astype(np.float64)
  if agree:
    reward = np.round(rng.random(num_trees), 2)[tree]
  reward = np.where(is_leaf, reward, 0.0).astype(np.float32)
  return dict(parent=parent, is_leaf=is_leaf, reward=reward, tree=tree, valid=valid)


def _ancestors(parent, i):
  out = [i]
  while parent[out[-1]] >= 0:
    out.append(int(parent[out[-1]]))
  return out


def _np_values(f):
  parent, leaf, r, valid = f["parent"], f["is_leaf"], f["reward"], f["valid"]
  total, count = np.zeros(_N), np.zeros(_N)
  for i in np.flatnonzero(leaf & valid):
    for a in _ancestors(parent, i):
      total[a] += r[i]
      count[a] += 1
  return np.where(count > 0, total / np.maximum(count, 1), 0.0), count


def _np_child_values(f):
  """The child-mean recursion: V(leaf) = r, V(y) = mean of V(c) over children c with leaves."""
  parent, leaf, r, valid = f["parent"], f["is_leaf"], f["reward"], f["valid"]
  _, count = _np_values(f)
  v = np.zeros(_N)
  for y in reversed(range(_N)):  # parents come before children: children are done first
    if not valid[y] or count[y] == 0:
      continue
    if leaf[y]:
      v[y] = r[y]
      continue
    kids = [c for c in np.flatnonzero(valid & (parent == y)) if count[c] > 0]
    v[y] = np.mean(v[kids])
  return v, count


def _np_vals(f, values):
  return _np_child_values(f) if values == "children" else _np_values(f)


def _np_root_of(f, i):
  return _ancestors(f["parent"], i)[-1]


def _np_tree_stats(f):
  leaf = f["is_leaf"] & f["valid"]
  mean, std = np.zeros(_N), np.zeros(_N)
  for t in np.unique(f["tree"][f["valid"]]):
    rs = f["reward"][leaf & (f["tree"] == t)].astype(np.float64)
    sel = f["tree"] == t
    mean[sel] = rs.mean() if rs.size else 0.0
    std[sel] = rs.std() if rs.size else 0.0
  return mean, std


def _np_branch_point(f, i):
  parent = f["parent"]
  nchild = np.bincount(parent[f["valid"] & (parent >= 0)], minlength=_N)
  a = int(parent[i])
  while parent[a] >= 0 and nchild[a] < 2:
    a = int(parent[a])
  return a


def _np_contrastive(f, normalize=True, values="children"):
  v, n = _np_vals(f, values)
  _, std = _np_tree_stats(f)
  out = np.zeros(_N)
  for i in np.flatnonzero(f["valid"] & (f["parent"] >= 0) & (n > 0)):
    d = v[i] - v[_np_branch_point(f, i)]
    out[i] = d / (std[i] + _EPS) if normalize else d
  return out


def _call(fn, f, **kw):
  return np.asarray(fn(f["parent"], f["is_leaf"], f["reward"], f["tree"], f["valid"], _MAX_DEPTH,
                       **kw))


_jit = functools.partial(jax.jit, static_argnums=5)
_contrastive = _jit(adv.tree_contrastive_advantages, static_argnames=("normalize", "values"))
_grpo = _jit(adv.grpo_advantages, static_argnames="normalize")
_tree_grpo = _jit(adv.tree_grpo_advantages, static_argnames=("normalize", "values"))
_treerl = _jit(adv.treerl_advantages, static_argnames=("sqrt_leaf_norm", "values"))
_backup = jax.jit(adv.backup_values, static_argnums=(4, 5))


@_SETTINGS
@given(seed=_seeds, fractional=st.booleans())
def test_backup_values_match_leaf_means_and_visit_weighted_backup(seed, fractional):
  f = _forest(seed, fractional=fractional)
  adv.check_flat_tree(f["parent"], f["is_leaf"], f["valid"], f["tree"], _MAX_DEPTH)
  v, n = (np.asarray(x) for x in _backup(f["parent"], f["is_leaf"], f["reward"], f["valid"],
                                         _MAX_DEPTH, "leaves"))
  v_ref, n_ref = _np_values(f)
  np.testing.assert_allclose(v, v_ref, atol=1e-6)
  np.testing.assert_array_equal(n, n_ref)
  for y in np.flatnonzero(f["valid"] & ~f["is_leaf"] & (n > 0)):
    kids = np.flatnonzero(f["valid"] & (f["parent"] == y))
    np.testing.assert_allclose(n[y] * v[y], np.sum(n[kids] * v[kids]), atol=1e-5)
    assert n[y] == n[kids].sum()


@_SETTINGS
@given(seed=_seeds, fractional=st.booleans())
def test_child_mean_values_match_the_recursion(seed, fractional):
  f = _forest(seed, fractional=fractional)
  v, n = (np.asarray(x) for x in _backup(f["parent"], f["is_leaf"], f["reward"], f["valid"],
                                         _MAX_DEPTH, "children"))
  v_ref, n_ref = _np_child_values(f)
  np.testing.assert_allclose(v, v_ref, atol=1e-6)
  np.testing.assert_array_equal(n, n_ref)
  # Where every child of every node holds one leaf (no forks below a child), the two agree.
  v_leaf, _ = _np_values(f)
  for y in np.flatnonzero(f["valid"] & ~f["is_leaf"] & (n > 0)):
    kids = np.flatnonzero(f["valid"] & (f["parent"] == y) & (n > 0))
    if np.all(n[kids] == 1):
      np.testing.assert_allclose(v[y], v_leaf[y], atol=1e-6)


def test_child_mean_removes_the_stage2_fork_bias():
  # The example: 6 failed first rollouts (2 turns each); 4 continuations forked after the
  # first turn of rollout 1, 2 of them successes.
  parent, reward, is_leaf = [-1], [0.0], [False]
  for _ in range(6):
    turn = len(parent)
    parent += [0, turn]
    reward += [0.0, 0.0]
    is_leaf += [False, True]
  for r in (1.0, 1.0, 0.0, 0.0):
    parent.append(1)
    reward.append(r)
    is_leaf.append(True)
  parent, reward, is_leaf = np.array(parent), np.array(reward, np.float32), np.array(is_leaf)
  n = len(parent)
  tree, valid = np.zeros(n, np.int32), np.ones(n, bool)
  v_leaf, _ = adv.backup_values(parent, is_leaf, reward, valid, 3, "leaves")
  v_child, _ = adv.backup_values(parent, is_leaf, reward, valid, 3, "children")
  assert abs(float(v_leaf[0]) - 0.2) < 1e-6
  assert abs(float(v_child[0]) - 0.4 / 6) < 1e-6
  assert abs(float(v_child[1]) - 0.4) < 1e-6
  untouched = [3, 5, 7, 9, 11]  # the first turns of rollouts 2-6: nothing about them changed
  a_leaf = np.asarray(adv.tree_contrastive_advantages(parent, is_leaf, reward, tree, valid, 3,
                                                      values="leaves"))
  a_child = np.asarray(adv.tree_contrastive_advantages(parent, is_leaf, reward, tree, valid, 3))
  np.testing.assert_allclose(a_leaf[untouched], -0.2 / 0.4, atol=1e-4)  # sigma_tree = 0.4
  np.testing.assert_allclose(a_child[untouched], -(0.4 / 6) / 0.4, atol=1e-4)
  with pytest.raises(ValueError, match="value estimator"):
    adv.backup_values(parent, is_leaf, reward, valid, 3, "visits")


@_SETTINGS
@given(seed=_seeds, fractional=st.booleans(), normalize=st.booleans(),
       values=st.sampled_from(adv.VALUE_ESTIMATORS))
def test_contrastive_matches_reference(seed, fractional, normalize, values):
  f = _forest(seed, fractional=fractional)
  got = _call(_contrastive, f, normalize=normalize, values=values)
  ref = _np_contrastive(f, normalize, values)
  _, std = _np_tree_stats(f)
  ref = np.where(std > 1e-5, ref, 0.0)
  np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


@_SETTINGS
@given(seed=_seeds, fractional=st.booleans())
def test_no_branching_below_root_is_exactly_grpo(seed, fractional):
  f = _forest(seed, branching=False, fractional=fractional)
  mean, std = _np_tree_stats(f)
  # Plain GRPO: every node of a rollout gets its leaf's (r - mean) / (std + eps).
  ref = np.zeros(_N)
  for i in np.flatnonzero(f["is_leaf"]):
    for a in _ancestors(f["parent"], i)[:-1]:
      ref[a] = (f["reward"][i] - mean[i]) / (std[i] + _EPS) if std[i] > 1e-5 else 0.0
  np.testing.assert_allclose(_call(_contrastive, f), ref, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(_call(_grpo, f), ref, rtol=1e-4, atol=1e-4)


@_SETTINGS
@given(seed=_seeds)
def test_all_leaves_agree_gives_zero_advantages(seed):
  f = _forest(seed, agree=True)
  for fn in (_contrastive, _grpo, _tree_grpo, _treerl):
    np.testing.assert_array_equal(_call(fn, f), np.zeros(_N))


@_SETTINGS
@given(seed=_seeds, fractional=st.booleans(), values=st.sampled_from(adv.VALUE_ESTIMATORS))
def test_grpo_tree_grpo_treerl_match_reference(seed, fractional, values):
  f = _forest(seed, fractional=fractional)
  v_leaf, n = _np_values(f)
  v, _ = _np_vals(f, values)
  mean, std = _np_tree_stats(f)
  trained = f["valid"] & (f["parent"] >= 0) & (n > 0)
  spread = std > 1e-5
  grpo = np.where(trained & spread, (v_leaf - mean) / (std + _EPS), 0.0)  # always leaf means
  np.testing.assert_allclose(_call(_grpo, f), grpo, rtol=1e-4, atol=1e-4)
  tree_grpo, treerl = np.zeros(_N), np.zeros(_N)
  for i in np.flatnonzero(trained):
    s = _ancestors(f["parent"], i)[-2]  # The first-turn node above i.
    base = v[_np_root_of(f, i)]  # V(root): the leaf mean of the tree for values="leaves"
    leaves = [j for j in np.flatnonzero(f["is_leaf"]) if s in _ancestors(f["parent"], j)]
    std_s = np.std(f["reward"][leaves].astype(np.float64))
    intra = (v[i] - v[s]) / (std_s + _EPS) if std_s > 1e-5 else 0.0
    inter = (v[i] - base) / (std[i] + _EPS) if spread[i] else 0.0
    tree_grpo[i] = inter + intra
    if spread[i]:
      treerl[i] = ((v[i] - base) + (v[i] - v[_np_branch_point(f, i)])) / np.sqrt(n[i])
  np.testing.assert_allclose(_call(_tree_grpo, f, values=values), tree_grpo, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(_call(_treerl, f, values=values), treerl, rtol=1e-4, atol=1e-4)


def test_contrastive_hand_example():
  # Prompt 0 -> a (1) -> {b (2) -> leaf d (4) r=1, leaf e (5) r=0}; prompt 0 -> leaf c (3) r=0.
  parent = jnp.array([-1, 0, 1, 0, 2, 1])
  is_leaf = jnp.array([False, False, False, True, True, True])
  reward = jnp.array([0, 0, 0, 0, 1, 0], jnp.float32)
  tree = jnp.zeros(6, jnp.int32)
  valid = jnp.ones(6, bool)
  a = np.asarray(adv.tree_contrastive_advantages(parent, is_leaf, reward, tree, valid, 3,
                                                 normalize=False))
  v_root, v_a = (1 / 2 + 0) / 2, 1 / 2  # child means: V(a) = mean(V(b), V(e)), V(root) of a, c
  np.testing.assert_allclose(a, [0, v_a - v_root, 1 - v_a, -v_root, 1 - v_a, -v_a], atol=1e-6)
  # b has one child, so its leaf d contrasts with a (the branch point), like b itself.
  rl = np.asarray(adv.treerl_advantages(parent, is_leaf, reward, tree, valid, 3))
  np.testing.assert_allclose(rl[1], ((v_a - v_root) + (v_a - v_root)) / np.sqrt(2), atol=1e-6)
  v_root = 1 / 3  # the leaf mean
  rl = np.asarray(adv.treerl_advantages(parent, is_leaf, reward, tree, valid, 3, values="leaves"))
  np.testing.assert_allclose(rl[1], ((v_a - v_root) + (v_a - v_root)) / np.sqrt(2), atol=1e-6)


def test_vmap_over_stacked_forests():
  fs = [_forest(s, fractional=True) for s in range(3)]
  stacked = {k: np.stack([f[k] for f in fs]) for k in fs[0]}
  fn = jax.vmap(lambda p, l, r, t, v: adv.tree_contrastive_advantages(p, l, r, t, v, _MAX_DEPTH))
  got = np.asarray(fn(stacked["parent"], stacked["is_leaf"], stacked["reward"], stacked["tree"],
                      stacked["valid"]))
  for b, f in enumerate(fs):
    np.testing.assert_allclose(got[b], _call(_contrastive, f), atol=1e-5)


def test_check_flat_tree_rejects_bad_trees():
  f = _forest(3)
  ok = (f["parent"], f["is_leaf"], f["valid"], f["tree"])
  adv.check_flat_tree(*ok, _MAX_DEPTH)
  with pytest.raises(ValueError, match="before their children"):
    adv.check_flat_tree(np.array([1, -1]), np.array([False, True]), np.ones(2, bool),
                        np.zeros(2, np.int32), 3)
  with pytest.raises(ValueError, match="padded"):
    adv.check_flat_tree(np.array([-1, 0]), np.array([False, True]), np.array([True, False]),
                        np.zeros(2, np.int32), 3)
  with pytest.raises(ValueError, match="deeper"):
    adv.check_flat_tree(np.array([-1, 0, 1, 2]), np.array([False, False, False, True]),
                        np.ones(4, bool), np.zeros(4, np.int32), 2)


def _paths(f, rng, seq_len=24):
  """Root-to-leaf training sequences: prompt/observation tokens -1, each node 1-3 tokens."""
  tokens_of = {i: int(rng.integers(1, 4)) for i in range(_N)}
  rows = []
  for leaf in np.flatnonzero(f["is_leaf"]):
    row = [-1, -1]  # Prompt tokens.
    for node in _ancestors(f["parent"], leaf)[::-1][1:]:
      row += [node] * tokens_of[node] + [-1] * int(rng.integers(0, 2))
    rows.append(row + [-1] * (seq_len - len(row)))
  rows.append([-1] * seq_len)  # A padding sequence.
  return np.asarray(rows, np.int32), tokens_of


@_SETTINGS
@given(seed=_seeds)
def test_ownership_covers_each_generated_node_exactly_once(seed):
  f = _forest(seed)
  rng = np.random.default_rng(seed)
  ids, tokens_of = _paths(f, rng)
  order = rng.permutation(ids.shape[0])
  ids = ids[order]
  mask = np.asarray(jax.jit(adv.ownership_mask, static_argnums=1)(ids, _N))
  np.testing.assert_array_equal(np.asarray(jax.jit(adv.ownership_mask)(ids)), mask)
  assert not np.any(mask[ids < 0])
  for node in np.unique(ids[ids >= 0]):
    owners = [s for s in range(ids.shape[0]) if np.any(mask[s] & (ids[s] == node))]
    assert len(owners) == 1
    s = owners[0]
    assert s == min(s2 for s2 in range(ids.shape[0]) if np.any(ids[s2] == node))
    assert np.all(mask[s][ids[s] == node]) and mask[ids == node].sum() == tokens_of[node]


def test_token_advantages_gathers_per_node_values():
  ids = jnp.array([[-1, 0, 0, 2], [-1, 1, -1, -1]])
  out = adv.token_advantages(jnp.array([0.5, -1.0, 2.0]), ids)
  np.testing.assert_allclose(out, [[0, 0.5, 0.5, 2.0], [0, -1.0, 0, 0]])


def test_each_baseline_trains_with_its_own_advantage():
  from trace_jax.rl.batch import ADVANTAGES
  from trace_jax.allocation.strategies import advantage_for, names
  assert advantage_for("tree_grpo", "tree_contrastive") == "tree_grpo"
  assert advantage_for("arpo", "tree_contrastive") == "grpo"
  assert advantage_for("grpo", "treerl") == "grpo" and advantage_for("dapo", "treerl") == "grpo"
  for m in ("trace", "trace_tree", "root_only"):
    assert advantage_for(m, "treerl") == "treerl"
  assert all(advantage_for(m, "tree_contrastive") in ADVANTAGES for m in names())
  with pytest.raises(ValueError, match="unknown strategy"):
    advantage_for("nope", "grpo")
