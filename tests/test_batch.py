"""`build_sequences` and `pack_batch` on hand-built and random trees.

What must hold for the update step to train what the method says: every generated token of a node
is trained exactly once across the batch (a segment shared by several leaves is not counted once
per leaf), carries its node's advantage, every node's predictor target V(y) has weight 1 exactly
once, and packing loses nothing (segments, positions and per-token fields survive intact).
"""

import collections

import numpy as np
import pytest

from trace_jax.rl.batch import ADVANTAGES, build_sequences, node_advantages, pack_batch
from trace_jax.sampling.tree import Tree

MAX_DEPTH = 8


def _turn(tree, parent, gen, obs=(), done=False, reward=None):
  lp = [-0.1 * (k + 1) for k in range(len(gen))]  # distinct, so a shifted copy would show
  return tree.add_node(parent, gen_ids=list(gen), logprobs=lp, obs_ids=list(obs), done=done,
                       reward=reward)


def hand_tree(uid=0):
  """root -> n1 (branches to n2 and n3 -> n4), root -> n5. Leaf rewards n2=1, n4=0, n5=0."""
  t = Tree([1, 2, 3, 4], uid=uid)
  _turn(t, 0, [10, 11, 12], [13, 14])             # n1
  _turn(t, 1, [20, 21], done=True, reward=1.0)    # n2
  _turn(t, 1, [30], [31, 32])                     # n3
  _turn(t, 3, [40, 41], done=True, reward=0.0)    # n4
  _turn(t, 0, [50, 51], done=True, reward=0.0)    # n5
  return t


def random_tree(rng, uid=0, rollouts=5):
  """Rollouts that each start at a random anchor (root or internal turn boundary) and run 1-3
  turns to a leaf, so every node has a finished leaf below it."""
  t = Tree(rng.integers(5, 99, rng.integers(2, 6)).tolist(), uid=uid)
  for _ in range(rollouts):
    anchors = [n.id for n in t.nodes if not n.done]
    node = int(rng.choice(anchors))
    for d in range(int(rng.integers(1, 4))):
      gen = rng.integers(5, 99, rng.integers(1, 5)).tolist()
      last = d == 2 or rng.random() < 0.3
      if last:
        node = _turn(t, node, gen, done=True, reward=float(rng.random() < 0.5)).id
        break
      node = _turn(t, node, gen, rng.integers(5, 99, rng.integers(0, 4)).tolist()).id
    else:
      _turn(t, node, [7], done=True, reward=float(rng.random() < 0.5))
  return t


def _owners(trees):
  """Per sequence (in build_sequences order): global node id per token, generated mask."""
  out, offset = [], 0
  for t in trees:
    for leaf in t.leaves():
      _, gen, owner, _ = t.path_tokens(leaf.id)
      out.append((owner + offset, gen))
    offset += len(t.nodes)
  return out


def _forests():
  rng = np.random.default_rng(0)
  return {"hand": [hand_tree(0), hand_tree(1)],
          "random": [random_tree(rng, uid=i, rollouts=int(rng.integers(1, 7))) for i in range(4)]}


@pytest.fixture(scope="module", params=["hand", "random"])
def forest(request):
  return _forests()[request.param]


# ---- build_sequences -----------------------------------------------------------------------------
@pytest.mark.parametrize("values", ["children", "leaves"])
def test_hand_tree_tree_contrastive_values(values):
  t = hand_tree()
  seqs, flat, adv = build_sequences([t], "tree_contrastive", MAX_DEPTH, values=values)
  sigma = np.std([1.0, 0.0, 0.0])
  # Child mean: V(root) = mean(V(n1), V(n5)) = 0.25; leaf mean: 1 success in 3 leaves.
  v_root, v1 = (0.25 if values == "children" else 1 / 3), 0.5
  # Branch points: n1, n5 -> root; n2, n3 -> n1; n4 -> n1 (n3 has one child).
  want = np.array([0.0, v1 - v_root, 1 - v1, 0 - v1, 0 - v1, 0 - v_root]) / sigma
  np.testing.assert_allclose(adv, want, rtol=1e-4, atol=1e-5)
  v_root = 1 / 3  # the host tree's value (`Tree.backup`) is the leaf mean
  np.testing.assert_allclose(flat["value"], [v_root, v1, 1.0, 0.0, 0.0, 0.0], atol=1e-6)
  assert len(seqs) == 3
  # The first sequence (leaf n2) trains n1 and n2; the second (n4) only n3 and n4.
  s2, s4, s5 = seqs
  np.testing.assert_array_equal(s2["tokens"], [1, 2, 3, 4, 10, 11, 12, 13, 14, 20, 21])
  np.testing.assert_array_equal(s2["mask"], [0, 0, 0, 0, 1, 1, 1, 0, 0, 1, 1])
  np.testing.assert_array_equal(s4["mask"], [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 1, 1])
  np.testing.assert_array_equal(s5["mask"], [0, 0, 0, 0, 1, 1])
  np.testing.assert_array_equal(s4["pred_weight"], [0, 0, 1, 0])  # n3 only; leaves weigh 0
  np.testing.assert_allclose(s4["pred_target"], [v_root, v1, 0.0, 0.0], atol=1e-6)
  np.testing.assert_allclose(s2["old_logp"][4:7], [-0.1, -0.2, -0.3], atol=1e-7)


@pytest.mark.parametrize("kind", sorted(ADVANTAGES))
def test_every_generated_token_trained_once_with_its_node_advantage(forest, kind):
  seqs, flat, adv = build_sequences(forest, kind, MAX_DEPTH)
  trained = collections.Counter()
  for (owner, gen), s in zip(_owners(forest), seqs):
    assert len(s["tokens"]) == len(owner) == len(s["mask"]) == len(s["adv"])
    assert not s["mask"][~gen].any(), "prompt or observation token trained"
    np.testing.assert_allclose(s["adv"][gen], adv[owner[gen]], rtol=1e-6)
    assert not s["adv"][~gen].any()
    for nid in owner[s["mask"] > 0]:
      trained[int(nid)] += 1
  gen_counts = {i: int(n) for i, n in enumerate(flat["num_gen_tokens"]) if n > 0}
  assert dict(trained) == gen_counts


def test_predictor_targets_once_per_node(forest):
  seqs, flat, _ = build_sequences(forest, "tree_contrastive", MAX_DEPTH, pred_leaf_weight=1.0)
  weight = collections.Counter()
  offset, k = 0, 0
  for t in forest:
    for leaf in t.leaves():
      s = seqs[k]
      k += 1
      path = t.path(leaf.id)
      assert len(s["pred_pos"]) == len(path)
      for j, nid in enumerate(path):
        assert s["pred_pos"][j] == t.prefix_len(nid) - 1  # last token of the prefix H
        assert s["pred_target"][j] == pytest.approx(t.nodes[nid].value, abs=1e-6)
        weight[nid + offset] += s["pred_weight"][j]
    offset += len(t.nodes)
  assert set(weight) == set(range(offset))
  assert all(w == 1.0 for w in weight.values())
  assert 0.0 <= min(flat["value"]) and max(flat["value"]) <= 1.0
  # By default leaves, never queried at allocation, weigh nothing; every other node still once.
  seqs0, _, _ = build_sequences(forest, "tree_contrastive", MAX_DEPTH)
  leaves = sum(len(t.leaves()) for t in forest)
  assert sum(s["pred_weight"].sum() for s in seqs0) == offset - leaves


def test_predictor_targets_leave_out_continuations_forked_below():
  """A stage-2 continuation forked from n1 counts for its own nodes only, not for n1 (whose
  stage-1 outcome placed it) nor the root: the root's target is the mean of the rollouts started
  at the root."""
  t = Tree([1, 2], uid=0)
  a = t.add_node(0, gen_ids=[5], obs_ids=[6], rollout=0)
  t.add_node(a.id, gen_ids=[7], done=True, reward=0.0, rollout=0)
  t.add_node(0, gen_ids=[8], done=True, reward=0.0, rollout=1)
  for r in range(2, 5):  # three continuations from n1, all successes
    t.add_node(a.id, gen_ids=[9], done=True, reward=1.0, rollout=r)
  seqs, flat, _ = build_sequences([t], "tree_contrastive", MAX_DEPTH)
  assert flat["value"][0] == pytest.approx(0.6)  # the advantage still sees every leaf
  root_targets = {float(s["pred_target"][0]) for s in seqs}
  assert root_targets == {0.0}                    # only rollouts 0 and 1 started at the root
  n1 = [float(s["pred_target"][1]) for s in seqs if len(s["pred_target"]) == 3]
  assert set(n1) == {0.0}  # n1: its own stage-1 rollout, not the forks its outcome placed


@pytest.mark.parametrize("kind", sorted(ADVANTAGES))
@pytest.mark.parametrize("reward", [0.0, 1.0])
def test_all_leaves_agree_gives_zero_advantage(kind, reward):
  rng = np.random.default_rng(3)
  trees = [hand_tree(), random_tree(rng, rollouts=5)]
  for t in trees:
    for n in t.leaves():
      n.reward = reward
  seqs, flat, adv = build_sequences(trees, kind, MAX_DEPTH)
  np.testing.assert_array_equal(adv, 0.0)
  assert all(not s["adv"].any() for s in seqs)
  for norm in (True, False):
    assert not node_advantages(flat, kind, MAX_DEPTH, norm).any()


def test_unbranched_tree_is_grpo():
  """No branching below the root: tree-contrastive advantages equal GRPO's."""
  t = Tree([1, 2], uid=0)
  for r in (1.0, 0.0, 0.0, 1.0):
    a = _turn(t, 0, [5, 6], [7])
    _turn(t, a.id, [8], done=True, reward=r)
  _, _, tc = build_sequences([t], "tree_contrastive", MAX_DEPTH)
  _, _, gr = build_sequences([t], "grpo", MAX_DEPTH)
  np.testing.assert_allclose(tc, gr, atol=1e-6)
  np.testing.assert_allclose(tc[1:3], [1.0, 1.0], rtol=1e-4)  # (1 - 0.5) / 0.5


def test_unknown_advantage_raises():
  with pytest.raises(ValueError, match="unknown advantage"):
    build_sequences([hand_tree()], "nope", MAX_DEPTH)


# ---- pack_batch ----------------------------------------------------------------------------------
def _segments(b):
  """{(row, segment id): slice} of a packed batch."""
  out = {}
  for r in range(b["tokens"].shape[0]):
    for s in np.unique(b["segment_ids"][r]):
      if s == 0:
        continue
      idx = np.nonzero(b["segment_ids"][r] == s)[0]
      assert np.all(np.diff(idx) == 1), "a segment is not contiguous"
      out[(r, int(s))] = slice(idx[0], idx[-1] + 1)
  return out


@pytest.mark.parametrize("row_len,row_multiple", [(40, 8), (64, 3), (200, 1)])
def test_pack_preserves_every_sequence(forest, row_len, row_multiple):
  seqs, _, _ = build_sequences(forest, "tree_contrastive", MAX_DEPTH)
  longest = max(len(s["tokens"]) for s in seqs)
  assert longest <= row_len  # long sequences: test_pack_cuts_long_sequences
  b, info = pack_batch(seqs, row_len, preds_per_row=32, row_multiple=row_multiple)
  R = b["tokens"].shape[0]
  assert R % row_multiple == 0 and R >= info["rows"]
  assert info["sequences"] == len(seqs) and info["cut_sequences"] == 0
  segs = _segments(b)
  assert len(segs) == len(seqs)
  # Match every segment to a distinct sequence by content.
  unmatched = list(range(len(seqs)))
  pred_seen = 0
  for (r, s), sl in sorted(segs.items()):
    toks = b["tokens"][r, sl]
    match = [i for i in unmatched if np.array_equal(seqs[i]["tokens"], toks)
             and np.array_equal(seqs[i]["adv"], b["adv"][r, sl])
             and np.array_equal(seqs[i]["old_logp"], b["old_logp"][r, sl])]
    assert match, f"row {r} segment {s} matches no sequence"
    q = seqs[match[0]]
    unmatched.remove(match[0])
    np.testing.assert_array_equal(b["positions"][r, sl], np.arange(len(toks)))
    assert b["mask"][r, sl.start] == 0.0  # no context for the first token of a segment
    np.testing.assert_array_equal(b["mask"][r, sl][1:], q["mask"][1:])
    # Predictor slots of this segment: positions shifted by the segment's start.
    in_seg = (b["pred_pos"][r] >= sl.start) & (b["pred_pos"][r] < sl.stop) & \
        (b["pred_weight"][r] + b["pred_target"][r] > 0)
    got = sorted(zip(b["pred_pos"][r][in_seg] - sl.start, b["pred_target"][r][in_seg],
                     b["pred_weight"][r][in_seg]))
    want = sorted((p, t, w) for p, t, w in zip(q["pred_pos"], q["pred_target"], q["pred_weight"])
                  if t + w > 0)
    np.testing.assert_allclose(np.asarray(got, float).reshape(-1, 3),
                               np.asarray(want, float).reshape(-1, 3), atol=1e-6)
    pred_seen += len(want)
  assert not unmatched
  # Padding is inert; every owned generated token is trained (prompts start every segment).
  pad = b["segment_ids"] == 0
  assert not b["mask"][pad].any() and not b["tokens"][pad].any()
  assert b["pred_weight"].sum() == sum(s["pred_weight"].sum() for s in seqs)
  assert info["trained_tokens"] == sum(s["mask"].sum() for s in seqs)
  assert 0 < info["fill"] <= 1


def test_pack_min_rows_and_multiple():
  seqs, _, _ = build_sequences([hand_tree()], "grpo", MAX_DEPTH)
  b, info = pack_batch(seqs, 64, 16, row_multiple=4)
  assert b["tokens"].shape == (4, 64) and info["rows"] == 1  # 11 + 14 + 6 tokens fit one row
  b, _ = pack_batch(seqs, 64, 16, row_multiple=4, min_rows=10)
  assert b["tokens"].shape[0] == 10
  b, info = pack_batch(seqs, 14, 16, row_multiple=2)
  assert info["rows"] == 3 and b["tokens"].shape[0] == 4


def test_pack_respects_preds_per_row():
  seqs, _, _ = build_sequences([hand_tree()], "grpo", MAX_DEPTH, pred_leaf_weight=1.0)
  # Paths of 4 (n4, longest), 3 (n2) and 2 (n5) nodes: n2 cannot join n4's row, n5 joins n2's.
  b, info = pack_batch(seqs, 64, 5, row_multiple=1)
  assert info["rows"] == 2
  assert (b["pred_weight"] > 0).sum() == 6  # root, n1..n5 once each
  _, info = pack_batch(seqs, 64, 4, row_multiple=1)
  assert info["rows"] == 3
  with pytest.raises(ValueError, match="preds_per_row"):
    pack_batch(seqs, 64, 3, row_multiple=1)


def test_pack_cuts_long_sequences():
  seqs, _, _ = build_sequences([hand_tree()], "tree_contrastive", MAX_DEPTH)
  b, info = pack_batch(seqs, 10, 16, row_multiple=1)
  assert info["cut_sequences"] == 2  # 11 and 14 tokens
  assert (b["segment_ids"] > 0).sum(1).max() <= 10
  # Predictor positions beyond the cut are dropped, never pointing past a segment.
  for r in range(b["tokens"].shape[0]):
    used = b["pred_weight"][r] + b["pred_target"][r] > 0
    assert np.all(b["segment_ids"][r][b["pred_pos"][r][used]] > 0)
