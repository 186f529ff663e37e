"""Advantages over a flat forest of rollout trees, and the token ownership mask.

Flat tree contract (shared with the tree and sampler code), arrays over N nodes of one or more
trees:
  parent: i32[N]  parent index, -1 for a root (the prompt node, which has no generated tokens).
  is_leaf: bool[N]  a finished trajectory ends at this node.
  reward: f32[N]  terminal reward in [0, 1], read at leaves only.
  tree: i32[N]  tree (prompt) index in [0, T); T <= N.
  valid: bool[N]  padding mask; padded nodes have parent -1 and valid False.
Parents come before their children (parent[i] < i); `check_flat_tree` verifies it and the rest of
the contract on the host, for tests and debugging, never in a hot path. `max_depth` (static) bounds
the depth of any node, the root having depth 0.

Every function is a pure, jittable map of these arrays to per-node values. A node's advantage
applies to its generated tokens; roots, padding and nodes without any finished leaf below get 0.

Contrast target. A node whose parent has a single child has the same leaves, hence the same V, as
that parent, so contrasting with the literal parent would give every later turn of an unbranched
rollout zero advantage. All contrastive advantages here therefore compare a node with its *branch
point*: the nearest proper ancestor that has at least two children, or the root. Nodes on an
unbranched chain thus share one advantage, and a tree with no branching below the root gets exactly
GRPO.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Leaf rewards whose std is below this count as all equal: V sums of equal fractional rewards can
# differ by rounding, and dividing that by eps would turn it into a sizeable fake advantage.
_MIN_STD = 1e-5


def check_flat_tree(parent, is_leaf, valid, tree, max_depth: int) -> None:
  """Host-side check of the flat tree contract. Raises ValueError naming the first violation."""
  parent, is_leaf, valid, tree = (np.asarray(x) for x in (parent, is_leaf, valid, tree))
  n = parent.shape[0]
  idx = np.arange(n)
  if np.any(parent[~valid] != -1):
    raise ValueError("padded nodes must have parent -1")
  if np.any(is_leaf[~valid]):
    raise ValueError("padded nodes must not be leaves")
  has_parent = valid & (parent >= 0)
  if np.any(parent[has_parent] >= idx[has_parent]):
    raise ValueError("parents must come before their children (parent[i] < i)")
  if np.any(~valid[parent[has_parent]]):
    raise ValueError("a valid node has a padded parent")
  if np.any(tree[has_parent] != tree[parent[has_parent]]):
    raise ValueError("a node and its parent are in different trees")
  if np.any(is_leaf[valid & (parent < 0)]):
    raise ValueError("a root (prompt node) cannot be a leaf")
  if np.any(is_leaf[parent[has_parent]]):
    raise ValueError("a leaf has children")
  if np.any((tree[valid] < 0) | (tree[valid] >= n)):
    raise ValueError("tree indices must lie in [0, N)")
  depth = np.asarray(node_depth(parent, max_depth + 1))
  if np.any(depth[valid] > max_depth):
    raise ValueError(f"a node is deeper than max_depth={max_depth}")


def _gather(x, idx):
  """x[idx] with idx == -1 (no node) mapped to index 0; callers mask those entries."""
  return x[jnp.maximum(idx, 0)]


def node_depth(parent, max_depth: int):
  """Depth of every node (roots 0), counting at most `max_depth` steps up. i32[N]."""
  parent = jnp.asarray(parent, jnp.int32)

  def up(_, carry):
    depth, cur = carry
    has = cur >= 0
    return depth + has, jnp.where(has, _gather(parent, cur), -1)

  depth, _ = jax.lax.fori_loop(0, max_depth, up, (jnp.zeros_like(parent), parent))
  return depth


def _subtree_sums(parent, weight, values, max_depth: int):
  """Sums over each node's subtree of per-node (weight, weight * value) pairs. Two f32[N].

  Each node pushes its contribution to itself and to its ancestors: one parallel scatter per level,
  O(N * max_depth) work, instead of a sequential reverse sweep over the topological order.
  """
  n = parent.shape[0]

  def up(_, carry):
    w_sum, v_sum, cur = carry
    seg = jnp.where(cur >= 0, cur, n)  # Out of range: dropped.
    w_sum = w_sum.at[seg].add(weight, mode="drop")
    v_sum = v_sum.at[seg].add(weight * values, mode="drop")
    return w_sum, v_sum, jnp.where(cur >= 0, _gather(parent, cur), -1)

  zeros = jnp.zeros((n,), jnp.float32)
  start = jnp.arange(n, dtype=jnp.int32)
  w_sum, v_sum, _ = jax.lax.fori_loop(0, max_depth + 1, up, (zeros, zeros, start))
  return w_sum, v_sum


VALUE_ESTIMATORS = ("children", "leaves")


def backup_values(parent, is_leaf, reward, valid, max_depth: int, estimator: str = "children"):
  """Value of every node's subtree and its leaf count.

  Two estimators of V(y), the success probability of the policy continuing from prefix y:
    "children" (default): V(leaf) = r; V(y) = (1 / |C_y|) sum over y's children c with a finished
      leaf below of V(c). Each child of a branch point is one independent draw of the policy's next
      turn, so the plain mean over children is unbiased for V(y) however many continuations were
      later forked *below* a child. Stage 2 forks continuations into chosen subtrees; with the leaf
      mean those subtrees weigh as many times as they hold leaves, which biases V at every branch
      point above a fork toward the forked subtree's outcomes.
    "leaves": V(y) = (1 / n_y) sum of r over the leaves below y (the visit-weighted backup
      (1 / n_y) sum_c n_c V(c)). Equal to "children" when every child holds the same number of
      leaves (a GRPO group, a uniformly forked tree); kept to reproduce runs from before the change.

  Example of the difference: a prompt with 6 failed first rollouts, then 4 continuations forked
  after the first turn of rollout 1, 2 of them successes. Leaf mean: V(root) = 2/10 = 0.2. Child
  mean: V(turn 1 of rollout 1) = 2/5 (its own failed continuation and the 4 forks, one draw each)
  and V(root) = (0.4 + 5 * 0) / 6 = 0.067.

  Which estimators this changes: `tree_contrastive_advantages` (V(c) and V(b(c))),
  `tree_grpo_advantages` (V(c), V(s) and the prompt baseline, which becomes V(root)) and
  `treerl_advantages` (V(c), V(b(c)), V(root)). `grpo_advantages` keeps the leaf mean: GRPO's
  baseline is by definition the mean reward of the group it trains.

  Args:
    parent: i32[N]; is_leaf: bool[N]; reward: f32[N]; valid: bool[N]; max_depth: static int.
    estimator: "children" or "leaves" (static).

  Returns:
    V: f32[N] (0 where n == 0), n: f32[N] leaf counts.

  Example:
    >>> parent = jnp.array([-1, 0, 0, 1, 1])  # prompt; turns 1, 2; node 1 branches into 3, 4
    >>> is_leaf, reward = jnp.arange(5) >= 2, jnp.array([0.0, 0.0, 0.0, 1.0, 0.0])
    >>> v, n = backup_values(parent, is_leaf, reward, jnp.ones(5, bool), max_depth=2)
    >>> print(np.asarray(v).round(2), n.tolist())  # V(root) = mean(V(1)=0.5, V(2)=0)
    [0.25 0.5  0.   1.   0.  ] [3.0, 2.0, 1.0, 1.0, 1.0]
    >>> v, _ = backup_values(parent, is_leaf, reward, jnp.ones(5, bool), 2, estimator="leaves")
    >>> print(np.asarray(v).round(2))  # V(root) = 1 success of 3 leaves
    [0.33 0.5  0.   1.   0.  ]
  """
  if estimator not in VALUE_ESTIMATORS:
    raise ValueError(f"unknown value estimator {estimator!r}; choose one of {VALUE_ESTIMATORS}")
  parent = jnp.asarray(parent, jnp.int32)
  valid = jnp.asarray(valid, bool)
  leaf = (jnp.asarray(is_leaf, bool) & valid).astype(jnp.float32)
  reward = jnp.asarray(reward, jnp.float32)
  n, total = _subtree_sums(parent, leaf, jnp.where(leaf > 0, reward, 0.0), max_depth)
  if estimator == "leaves":
    return jnp.where(n > 0, total / jnp.maximum(n, 1.0), 0.0), n
  return _child_mean_values(parent, leaf, reward, valid, n, max_depth), n


def _child_mean_values(parent, leaf, reward, valid, n, max_depth: int):
  """V by the child-mean recursion, one level per iteration from the deepest up. f32[N].

  At level d every node of depth d is final (its children, at d + 1, were folded in the previous
  iteration), so it pushes V to its parent's (sum, count) with one scatter; the parents of depth
  d - 1 that are not leaves then read their mean. O(N * max_depth) work, like `_subtree_sums`.
  """
  size = parent.shape[0]
  depth = node_depth(parent, max_depth + 1)
  counts = valid & (n > 0)  # A child without a finished leaf below carries no outcome.
  seg_parent = jnp.where(parent >= 0, parent, size)
  v0 = jnp.where(leaf > 0, reward, 0.0)

  def level(i, v):
    d = max_depth - i
    push = counts & (depth == d)
    seg = jnp.where(push, seg_parent, size)
    s = jnp.zeros((size,), jnp.float32).at[seg].add(v, mode="drop")
    k = jnp.zeros((size,), jnp.float32).at[seg].add(1.0, mode="drop")
    inner = (depth == d - 1) & (leaf == 0) & (k > 0)
    return jnp.where(inner, s / jnp.maximum(k, 1.0), v)

  return jax.lax.fori_loop(0, max_depth + 1, level, v0)


def _tree_leaf_stats(is_leaf, reward, tree, valid):
  """Mean and (population) std of each node's tree's leaf rewards, gathered per node. Two f32[N]."""
  leaf = (jnp.asarray(is_leaf, bool) & jnp.asarray(valid, bool)).astype(jnp.float32)
  reward = jnp.where(leaf > 0, jnp.asarray(reward, jnp.float32), 0.0)
  tree = jnp.asarray(tree, jnp.int32)
  n = tree.shape[0]
  seg = jnp.where(jnp.asarray(valid, bool), tree, n)
  count = jnp.zeros((n,), jnp.float32).at[seg].add(leaf, mode="drop")
  total = jnp.zeros((n,), jnp.float32).at[seg].add(leaf * reward, mode="drop")
  mean = total / jnp.maximum(count, 1.0)
  dev2 = leaf * (reward - mean[jnp.clip(seg, 0, n - 1)]) ** 2
  sq = jnp.zeros((n,), jnp.float32).at[seg].add(dev2, mode="drop")
  std = jnp.sqrt(sq / jnp.maximum(count, 1.0))
  node_tree = jnp.clip(tree, 0, n - 1)
  return mean[node_tree], std[node_tree]


def _root_values(v, parent, tree, valid):
  """V of each node's tree root (the prompt node), gathered per node. f32[N]."""
  size = parent.shape[0]
  tree = jnp.asarray(tree, jnp.int32)
  seg = jnp.where(jnp.asarray(valid, bool) & (parent < 0), tree, size)
  root_v = jnp.zeros((size,), jnp.float32).at[seg].set(v, mode="drop")
  return root_v[jnp.clip(tree, 0, size - 1)]


def _num_children(parent, valid):
  n = parent.shape[0]
  seg = jnp.where(valid & (parent >= 0), parent, n)
  return jnp.zeros((n,), jnp.int32).at[seg].add(1, mode="drop")


def branch_point(parent, valid, max_depth: int):
  """Nearest proper ancestor with >= 2 children, or the root; -1 for roots and padding. i32[N]."""
  parent = jnp.asarray(parent, jnp.int32)
  valid = jnp.asarray(valid, bool)
  num_children = _num_children(parent, valid)
  is_root = valid & (parent < 0)

  def up(_, anc):
    stop = (anc < 0) | _gather(is_root, anc) | (_gather(num_children, anc) >= 2)
    return jnp.where(stop, anc, _gather(parent, anc))

  anc = jnp.where(valid, parent, -1)
  return jax.lax.fori_loop(0, max(max_depth - 1, 0), up, anc)


def _first_turn_ancestor(parent, valid, max_depth: int):
  """The depth-1 ancestor of each node (itself at depth 1); -1 for roots and padding. i32[N]."""
  parent = jnp.asarray(parent, jnp.int32)
  valid = jnp.asarray(valid, bool)

  def up(_, top):
    p = _gather(parent, top)
    move = (top >= 0) & (p >= 0) & (_gather(parent, p) >= 0)
    return jnp.where(move, p, top)

  top = jnp.where(valid & (parent >= 0), jnp.arange(parent.shape[0], dtype=jnp.int32), -1)
  return jax.lax.fori_loop(0, max(max_depth - 1, 0), up, top)


def _trained(parent, valid, n):
  return jnp.asarray(valid, bool) & (jnp.asarray(parent) >= 0) & (n > 0)


def tree_contrastive_advantages(parent, is_leaf, reward, tree, valid, max_depth: int, *,
                                normalize: bool = True, eps: float = 1e-6,
                                values: str = "children"):
  """TRACE's default advantage: A_c = (V(c) - V(b(c))) / (sigma_tree + eps).

  b(c) is c's branch point (module docstring), V the child-mean values of `backup_values` (unbiased
  under stage-2 forks; values="leaves" for the leaf mean), sigma_tree the population std of the
  leaf rewards of c's tree. `normalize=False` drops the division (Dr.GRPO style).

  Why sigma_tree is the leaf std: it is a scale, not a baseline. It is one constant per tree, so it
  changes no sign and no order of advantages within a tree, only the step size a tree gets; the
  leaves are the samples whose tokens are trained, and their std is 0 exactly when every outcome
  of the tree is equal (no contrast, advantage 0), as GRPO's group std is. A child-weighted std
  would shrink the weight of the forked subtree's leaves, whose outcomes are the ones trained.

  Args:
    parent, is_leaf, reward, tree, valid: the flat tree arrays, [N] (module docstring).
    max_depth: static int.
    normalize: divide by sigma_tree + eps.
    values: "children" or "leaves", the estimator of V (`backup_values`).

  Returns:
    f32[N] per-node advantages.

  Example:
    >>> parent = jnp.array([-1, 0, 0, 1, 1])  # prompt; turns 1, 2; node 1 branches into 3, 4
    >>> is_leaf, reward = jnp.arange(5) >= 2, jnp.array([0.0, 0.0, 0.0, 1.0, 0.0])
    >>> adv = tree_contrastive_advantages(parent, is_leaf, reward, jnp.zeros(5, int),
    ...                                   jnp.ones(5, bool), max_depth=2)
    >>> print(np.asarray(adv).round(2))  # node 3 vs its sibling 4, node 1 vs sibling 2
    [ 0.    0.53 -0.53  1.06 -1.06]
  """
  parent = jnp.asarray(parent, jnp.int32)
  v, n = backup_values(parent, is_leaf, reward, valid, max_depth, values)
  anc = branch_point(parent, valid, max_depth)
  _, std = _tree_leaf_stats(is_leaf, reward, tree, valid)
  adv = jnp.where(std > _MIN_STD, v - _gather(v, anc), 0.0)
  if normalize:
    adv = adv / (std + eps)
  return jnp.where(_trained(parent, valid, n), adv, 0.0)


def grpo_advantages(parent, is_leaf, reward, tree, valid, max_depth: int, *,
                    normalize: bool = True, eps: float = 1e-6):
  """GRPO on a tree: each leaf's group-relative advantage, group = all leaves of its tree.

  A leaf l gets (r_l - mean_tree) / (sigma_tree + eps). A node shared by several leaves gets the
  mean of their advantages, (V(c) - mean_tree) / (sigma_tree + eps), so training each shared node
  once (the ownership mask) gives it the average of the per-leaf signals; on an unbranched path
  every node gets its leaf's advantage, as in plain GRPO.

  Args:
    parent, is_leaf, reward, tree, valid: the flat tree arrays, [N] (module docstring).
    max_depth: static int.
    normalize: divide by sigma_tree + eps.

  Returns:
    f32[N] per-node advantages.

  Example:
    >>> parent = jnp.array([-1, 0, 0, 1, 1])  # prompt; turns 1, 2; node 1 branches into 3, 4
    >>> is_leaf, reward = jnp.arange(5) >= 2, jnp.array([0.0, 0.0, 0.0, 1.0, 0.0])
    >>> adv = grpo_advantages(parent, is_leaf, reward, jnp.zeros(5, int), jnp.ones(5, bool), 2)
    >>> print(np.asarray(adv).round(2))  # each leaf against the tree mean 1/3
    [ 0.    0.35 -0.71  1.41 -0.71]
  """
  parent = jnp.asarray(parent, jnp.int32)
  v, n = backup_values(parent, is_leaf, reward, valid, max_depth, "leaves")
  mean, std = _tree_leaf_stats(is_leaf, reward, tree, valid)
  adv = jnp.where(std > _MIN_STD, v - mean, 0.0)
  if normalize:
    adv = adv / (std + eps)
  return jnp.where(_trained(parent, valid, n), adv, 0.0)


def tree_grpo_advantages(parent, is_leaf, reward, tree, valid, max_depth: int, *,
                         normalize: bool = True, eps: float = 1e-6, values: str = "children"):
  """Tree-GRPO advantage: GRPO over the prompt plus GRPO within the subtree of a first rollout.

  Tree-GRPO sums an inter-tree term (leaves of all trees of a prompt) and an intra-tree term (leaves
  of the same tree). Here a prompt's rollouts form one tree whose root children are the first
  rollouts and whose deeper branches expand them, so for a leaf l under the first-turn node s:
    A_l = (r_l - mean_prompt) / (sigma_prompt + eps) + (r_l - V(s)) / (sigma_s + eps),
  sigma_s the population std of the leaf rewards under s. Shared nodes c under s get the mean over
  their leaves: (V(c) - mean_prompt) / (sigma_prompt + eps) + (V(c) - V(s)) / (sigma_s + eps).
  With values="children" (default) V is the child-mean value of `backup_values` and mean_prompt is
  V(root), the mean over the prompt's first rollouts, so a subtree that stage 2 forked into does not
  weigh more in either baseline; values="leaves" gives the leaf means of the original. The stds
  stay leaf stds (scales, see `tree_contrastive_advantages`).

  Args:
    parent, is_leaf, reward, tree, valid: the flat tree arrays, [N] (module docstring).
    max_depth: static int.
    normalize: divide each term by its std + eps.
    values: "children" or "leaves", the estimator of V (`backup_values`).

  Returns:
    f32[N] per-node advantages.

  Example:
    >>> parent = jnp.array([-1, 0, 0, 1, 1])  # prompt; turns 1, 2; node 1 branches into 3, 4
    >>> is_leaf, reward = jnp.arange(5) >= 2, jnp.array([0.0, 0.0, 0.0, 1.0, 0.0])
    >>> adv = tree_grpo_advantages(parent, is_leaf, reward, jnp.zeros(5, int), jnp.ones(5, bool), 2)
    >>> print(np.asarray(adv).round(2))
    [ 0.    0.53 -0.53  2.59 -1.53]
  """
  parent = jnp.asarray(parent, jnp.int32)
  reward = jnp.asarray(reward, jnp.float32)
  v, n = backup_values(parent, is_leaf, reward, valid, max_depth, values)
  v_leaf, _ = backup_values(parent, is_leaf, reward, valid, max_depth, "leaves")
  mean, std = _tree_leaf_stats(is_leaf, reward, tree, valid)
  baseline = mean if values == "leaves" else _root_values(v, parent, tree, valid)
  s = _first_turn_ancestor(parent, valid, max_depth)
  # Two-pass std under s (squared deviations from the leaf mean under s, summed up the tree) avoids
  # the cancellation of E[r^2] - V^2.
  leaf = (jnp.asarray(is_leaf, bool) & jnp.asarray(valid, bool)).astype(jnp.float32)
  dev2 = jnp.where(leaf > 0, (reward - _gather(v_leaf, s)) ** 2, 0.0)
  _, dev2_sum = _subtree_sums(parent, leaf, dev2, max_depth)
  std_s = jnp.sqrt(_gather(dev2_sum, s) / jnp.maximum(_gather(n, s), 1.0))
  inter = jnp.where(std > _MIN_STD, v - baseline, 0.0)
  intra = jnp.where(std_s > _MIN_STD, v - _gather(v, s), 0.0)
  if normalize:
    inter, intra = inter / (std + eps), intra / (std_s + eps)
  return jnp.where(_trained(parent, valid, n), inter + intra, 0.0)


def treerl_advantages(parent, is_leaf, reward, tree, valid, max_depth: int, *,
                      sqrt_leaf_norm: bool = True, values: str = "children"):
  """TreeRL's process signal: (global + local advantage) / sqrt(number of leaves below).

  TreeRL scores a step s by its global advantage V(s) - V(root) plus its local advantage
  V(s) - V(parent step), divided by the square root of the number of leaves under s, which damps
  steps that would be trained once per leaf. Its steps are the segments between forks, so the parent
  step is the branch point b(c) here:
    A_c = ((V(c) - V(root)) + (V(c) - V(b(c)))) / sqrt(n_c).
  V is the child-mean value of `backup_values` (values="leaves": the leaf mean, so V(root) is the
  tree's mean leaf reward, as in the original). With the ownership mask a shared node is trained
  once, not n_c times; `sqrt_leaf_norm=False` drops the division.

  Args:
    parent, is_leaf, reward, tree, valid: the flat tree arrays, [N] (module docstring).
    max_depth: static int.
    sqrt_leaf_norm: divide by sqrt(n_c).
    values: "children" or "leaves", the estimator of V (`backup_values`).

  Returns:
    f32[N] per-node advantages.

  Example:
    >>> parent = jnp.array([-1, 0, 0, 1, 1])  # prompt; turns 1, 2; node 1 branches into 3, 4
    >>> is_leaf, reward = jnp.arange(5) >= 2, jnp.array([0.0, 0.0, 0.0, 1.0, 0.0])
    >>> adv = treerl_advantages(parent, is_leaf, reward, jnp.zeros(5, int), jnp.ones(5, bool), 2)
    >>> print(np.asarray(adv).round(2))
    [ 0.    0.35 -0.5   1.25 -0.75]
  """
  parent = jnp.asarray(parent, jnp.int32)
  v, n = backup_values(parent, is_leaf, reward, valid, max_depth, values)
  mean, std = _tree_leaf_stats(is_leaf, reward, tree, valid)
  root_v = mean if values == "leaves" else _root_values(v, parent, tree, valid)
  anc = branch_point(parent, valid, max_depth)
  adv = jnp.where(std > _MIN_STD, (v - root_v) + (v - _gather(v, anc)), 0.0)
  if sqrt_leaf_norm:
    adv = adv / jnp.sqrt(jnp.maximum(n, 1.0))
  return jnp.where(_trained(parent, valid, n), adv, 0.0)


def ownership_mask(seq_node_ids, num_nodes: int | None = None):
  """Marks each node's tokens in exactly one training sequence: the first one that contains it.

  Training sequences are root-to-leaf paths, so a node shared by several leaves appears in several
  sequences; training it once keeps a shared prefix from counting n_c times in the loss.

  Args:
    seq_node_ids: i32[S, T] node id of each token, -1 for tokens that are not generated (prompt,
      observations) or padding.
    num_nodes: optional static int N with node ids in [0, N): one O(S T) scatter. Without it the
      first owner is found by sorting the S T (node, sequence) pairs.

  Returns:
    bool[S, T] True where the token is trained.

  Example:
    >>> ids = jnp.array([[-1, 1, 1, 3], [-1, 1, 1, 4]])  # two root-to-leaf paths sharing node 1
    >>> ownership_mask(ids).astype(int).tolist()
    [[0, 1, 1, 1], [0, 0, 0, 1]]
  """
  ids = jnp.asarray(seq_node_ids, jnp.int32)
  num_seqs = ids.shape[0]
  seq = jnp.broadcast_to(jnp.arange(num_seqs, dtype=jnp.int32)[:, None], ids.shape)
  if num_nodes is not None:
    seg = jnp.where(ids >= 0, ids, num_nodes)
    first = jnp.full((num_nodes,), num_seqs, jnp.int32).at[seg].min(seq, mode="drop")
    return (ids >= 0) & (_gather(first, ids) == seq)
  flat_ids, flat_seq = ids.reshape(-1), seq.reshape(-1)
  order = jnp.lexsort((flat_seq, flat_ids))  # By node, then sequence.
  sorted_ids, sorted_seq = flat_ids[order], flat_seq[order]
  pos = jnp.arange(flat_ids.shape[0])
  starts = jnp.concatenate([jnp.ones((1,), bool), sorted_ids[1:] != sorted_ids[:-1]])
  run_start = jax.lax.cummax(jnp.where(starts, pos, 0))
  owned_sorted = sorted_seq == sorted_seq[run_start]
  owned = jnp.zeros_like(owned_sorted).at[order].set(owned_sorted)
  return (ids >= 0) & owned.reshape(ids.shape)


def token_advantages(node_advantages, seq_node_ids):
  """Per-token advantages of training sequences from per-node ones; 0 on -1 tokens.

  Args:
    node_advantages: f32[N] per-node advantages.
    seq_node_ids: i32[S, T] node id of each token, -1 where not generated (as `ownership_mask`).

  Returns:
    f32[S, T].

  Example:
    >>> ids = jnp.array([[-1, 1, 1, 3], [-1, 1, 1, 4]])
    >>> token_advantages(jnp.array([0.0, 0.5, -1.0, 2.0, -2.0]), ids).tolist()
    [[0.0, 0.5, 0.5, 2.0], [0.0, 0.5, 0.5, -2.0]]
  """
  ids = jnp.asarray(seq_node_ids, jnp.int32)
  return jnp.where(ids >= 0, _gather(jnp.asarray(node_advantages, jnp.float32), ids), 0.0)
