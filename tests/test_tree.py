"""Rollout trees: paths, backup, flat export, serialization, rendering."""

import numpy as np
import pytest

from trace_jax.rl.advantages import check_flat_tree
from trace_jax.sampling.tree import Tree, load_trees, render_png, render_text, save_trees, to_flat


def make_tree(uid=0):
  """root(prompt 3 tokens) -> a (anchor) -> {b leaf r=1, c anchor -> d leaf r=0};
  root -> e leaf r=0."""
  t = Tree([1, 2, 3], uid=uid, meta={"question": "q"})
  a = t.add_node(0, gen_ids=[4, 5], logprobs=[-0.1, -0.2], obs_ids=[6, 7, 8])
  b = t.add_node(a.id, gen_ids=[9], logprobs=[-0.3], done=True, reward=1.0)
  c = t.add_node(a.id, gen_ids=[10, 11], logprobs=[-0.4, -0.5], obs_ids=[12])
  t.add_node(c.id, gen_ids=[13], logprobs=[-0.6], done=True, reward=0.0)
  t.add_node(0, gen_ids=[14, 15, 16], logprobs=[-1.0, -1.0, -1.0], done=True, reward=0.0,
             truncated="max_seq_len")
  a.feature = np.arange(4, dtype=np.float32)
  del b
  return t


def test_path_tokens_and_masks():
  t = make_tree()
  ids, mask, owner, lps = t.path_tokens(4)
  np.testing.assert_array_equal(ids, [1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13])
  np.testing.assert_array_equal(mask, [0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 0, 1])
  np.testing.assert_array_equal(owner, [0, 0, 0, 1, 1, 1, 1, 1, 3, 3, 3, 4])
  np.testing.assert_allclose(lps[mask], [-0.1, -0.2, -0.4, -0.5, -0.6])
  assert (lps[~mask] == 0).all()
  assert t.prefix_len(3) == 11 and t.path(4) == [0, 1, 3, 4]
  assert [n.id for n in t.leaves()] == [2, 4, 5]
  assert [n.id for n in t.anchors()] == [0, 1, 3]


def test_backup_values_and_counts():
  t = make_tree()
  t.backup()
  assert [n.n_leaves for n in t.nodes] == [3, 2, 1, 1, 1, 1]
  np.testing.assert_allclose([n.value for n in t.nodes], [1 / 3, 0.5, 1.0, 0.0, 0.0, 0.0])
  # Visit-weighted backup equals the mean leaf reward.
  a = t.nodes[1]
  assert a.value == pytest.approx(sum(t.nodes[c].n_leaves * t.nodes[c].value for c in a.children)
                                  / a.n_leaves)
  assert t.mixed


def test_to_flat_matches_advantages_format():
  trees = [make_tree(0), make_tree(1)]
  trees[1].nodes[2].reward = 0.0
  flat = to_flat(trees, pad_to=16)
  check_flat_tree(flat["parent"], flat["is_leaf"], flat["valid"], flat["tree"], max_depth=4)
  np.testing.assert_array_equal(flat["parent"][:12], [-1, 0, 1, 1, 3, 0, -1, 6, 7, 7, 9, 6])
  np.testing.assert_array_equal(flat["tree"][:12], [0] * 6 + [1] * 6)
  assert flat["valid"].sum() == 12 and not flat["valid"][12:].any()
  assert (flat["parent"][12:] == -1).all()
  np.testing.assert_allclose(flat["reward"][:6], [0, 0, 1, 0, 0, 0])
  np.testing.assert_allclose(flat["value"][6], 0.0)
  np.testing.assert_array_equal(flat["num_gen_tokens"][:6], [0, 2, 1, 2, 1, 3])
  assert flat["truncated"][5] and not flat["truncated"][4]
  with pytest.raises(ValueError):
    to_flat(trees, pad_to=5)


def test_json_roundtrip(tmp_path):
  t = make_tree()
  t.nodes[1].p_hat = 0.25
  u = Tree.from_json(t.to_json())
  assert u.to_dict() == t.to_dict()
  np.testing.assert_array_equal(u.nodes[1].feature, t.nodes[1].feature)
  assert u.nodes[2].feature is None and u.meta == {"question": "q"}
  path = str(tmp_path / "trees.jsonl")
  save_trees([t, make_tree(7)], path)
  back = load_trees(path)
  assert [x.uid for x in back] == [0, 7]
  for x in (u, back[0]):
    np.testing.assert_array_equal(x.path_tokens(4)[0], t.path_tokens(4)[0])


def test_render(tmp_path):
  t = make_tree()
  text = render_text(t)
  assert "leaf r=1.00" in text and "[max_seq_len]" in text and "anchor" in text
  assert len(text.splitlines()) == 7
  path = tmp_path / "trees.png"
  render_png([t, make_tree(1)], str(path))
  assert path.stat().st_size > 1000


def test_add_node_rejects_unknown_parent():
  with pytest.raises(IndexError):
    make_tree().add_node(42)
