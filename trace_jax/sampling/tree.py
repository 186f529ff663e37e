"""Rollout trees: one `Tree` per prompt, one `Node` per turn.

The root node is the prompt: no generated tokens, its token ids stored as the root's (masked)
observation. Every other node is one turn: the tokens the policy generated (trainable, with their
sampling-time logprobs) followed by the environment's observation tokens (masked). A node's prefix H
is every token on the path from the root up to and including the node's observation. Leaves are
finished trajectories (`done`) with a reward; anchors are the root and every internal turn boundary,
the prefixes continuations can be forked from.

`to_flat` exports the flat node arrays `trace_jax.rl.advantages` consumes (parents before children).
Trees hold only host data (numpy/lists): they pickle, serialize to JSON and plot without a device.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Iterable, Sequence

import numpy as np


@dataclasses.dataclass
class Node:
  """One turn (or the prompt, for the root).

  Attributes:
    id: index in `Tree.nodes`; parents always have smaller ids than their children.
    parent: parent id, -1 for the root.
    depth: 0 for the root, t for the t-th turn.
    gen_ids: generated token ids of the turn (trainable); empty for the root.
    logprobs: f32 log mu(token), one per gen id, under the behaviour distribution the sampler
      drew the token from: softmax(logits / temperature) restricted to the tokens top-k / top-p
      keep, renormalized (the plain tempered log-softmax when no filter is on; untempered and
      unfiltered for greedy sampling). PPO's ratio divides the update's tempered pi by it.
    entropies: entropy of the tempered, unfiltered next-token distribution softmax(logits /
      temperature) at each generated position (untempered for greedy sampling); a diagnostic.
    obs_ids: observation token ids (the prompt, for the root); masked for training.
    feature: f32[D] final hidden state at the node's last token (the prefix H for the predictor),
      or None when not computed.
    p_hat: the predictor's estimate at allocation time (set by the trainer).
    done: the trajectory ends at this node (a leaf).
    truncated: why the trajectory was cut ("max_seq_len", "max_turns", "pool_exhausted", ...) or "".
    reward: terminal reward for leaves, None otherwise.
    value, n_leaves: backed-up mean leaf reward V(y) and leaf count n_y of the subtree (`backup`).
    children: child ids.
    text, obs_text: decoded turn text and raw observation text (for inspection).
    rollout: index (within the tree) of the sampler branch that generated the turn, -1 if unknown.
  """

  id: int
  parent: int
  depth: int
  gen_ids: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  entropies: list[float] = dataclasses.field(default_factory=list)
  obs_ids: list[int] = dataclasses.field(default_factory=list)
  feature: np.ndarray | None = None
  p_hat: float | None = None
  done: bool = False
  truncated: str = ""
  reward: float | None = None
  value: float | None = None
  n_leaves: int = 0
  children: list[int] = dataclasses.field(default_factory=list)
  text: str = ""
  obs_text: str = ""
  rollout: int = -1

  @property
  def is_leaf(self) -> bool:
    return self.done

  @property
  def num_tokens(self) -> int:
    return len(self.gen_ids) + len(self.obs_ids)


class Tree:
  """All rollouts of one prompt.

  Attributes:
    uid: unique id (set by whoever creates the tree, e.g. the sampler).
    nodes: list of `Node`, nodes[0] is the root (the prompt).
    meta: free-form per-prompt data (question, gold answers, ...) for the environment and trainer.

  A tree is data only: the sampler keeps its own bookkeeping of a live tree (KV pages, worker,
  shard, branch counter) by uid, until `SamplerEngine.release`.
  """

  def __init__(self, prompt_ids: Sequence[int], uid: int = 0, meta: dict | None = None,
               prompt_text: str = ""):
    self.uid = uid
    self.meta = dict(meta or {})
    self.nodes: list[Node] = [Node(id=0, parent=-1, depth=0, obs_ids=list(map(int, prompt_ids)),
                                   obs_text=prompt_text)]

  # ---- structure ---------------------------------------------------------------------------------
  @property
  def root(self) -> Node:
    return self.nodes[0]

  @property
  def prompt_ids(self) -> list[int]:
    return self.root.obs_ids

  def add_node(self, parent: int, **fields) -> Node:
    """Appends a child of `parent` and returns it."""
    if not 0 <= parent < len(self.nodes):
      raise IndexError(f"parent {parent} not in tree of {len(self.nodes)} nodes")
    node = Node(id=len(self.nodes), parent=parent, depth=self.nodes[parent].depth + 1, **fields)
    self.nodes.append(node)
    self.nodes[parent].children.append(node.id)
    return node

  def canonicalize(self) -> dict[int, int] | None:
    """Renumbers the nodes in a canonical order, by (rollout, depth): the ids then depend on what
    was sampled, not on the order in which the branches' turns happened to end (which the
    sampler's schedule, its slots and its pool, decide). A node's parent comes first (its own
    rollout's earlier turn, or an anchor an earlier rollout made), and nodes already in canonical
    order keep their ids when later rollouts add nodes. Returns old id -> new id, or None when
    nothing moved."""
    order = sorted(range(len(self.nodes)),
                   key=lambda i: (-2 if i == 0 else self.nodes[i].rollout, self.nodes[i].depth, i))
    if order == list(range(len(self.nodes))):
      return None
    new_of = {old: new for new, old in enumerate(order)}
    nodes = [self.nodes[i] for i in order]
    for n in nodes:
      n.id = new_of[n.id]
      n.parent = new_of[n.parent] if n.parent >= 0 else -1
      n.children = sorted(new_of[c] for c in n.children)
    self.nodes[:] = nodes
    return new_of

  def path(self, node_id: int) -> list[int]:
    """Node ids from the root down to `node_id` (inclusive)."""
    ids = []
    while node_id >= 0:
      ids.append(node_id)
      node_id = self.nodes[node_id].parent
    return ids[::-1]

  def leaves(self) -> list[Node]:
    return [n for n in self.nodes if n.done]

  def anchors(self) -> list[Node]:
    """The root and every internal turn boundary (nodes whose trajectory continues)."""
    return [n for n in self.nodes if not n.done]

  def path_tokens(self, node_id: int):
    """Root-to-node token sequence.

    Returns:
      token_ids i32[T], trainable_mask bool[T] (generated tokens), node_id_per_token i32[T],
      old_logprobs f32[T] (0 at masked tokens).
    """
    ids, mask, owner, lps = [], [], [], []
    for nid in self.path(node_id):
      n = self.nodes[nid]
      ids += n.gen_ids + n.obs_ids
      mask += [True] * len(n.gen_ids) + [False] * len(n.obs_ids)
      owner += [nid] * n.num_tokens
      lps += list(n.logprobs) + [0.0] * len(n.obs_ids)
    return (np.asarray(ids, np.int32), np.asarray(mask, bool), np.asarray(owner, np.int32),
            np.asarray(lps, np.float32))

  def prefix_len(self, node_id: int) -> int:
    return sum(self.nodes[i].num_tokens for i in self.path(node_id))

  def backup(self) -> None:
    """Fills `value` (mean leaf reward of the subtree) and `n_leaves` for every node.

    Nodes without finished leaves below them (still running) get value None and n_leaves 0.
    """
    total = [0.0] * len(self.nodes)
    count = [0] * len(self.nodes)
    for n in reversed(self.nodes):  # children have larger ids than parents
      if n.done:
        total[n.id] += float(n.reward or 0.0)
        count[n.id] += 1
      if n.parent >= 0:
        total[n.parent] += total[n.id]
        count[n.parent] += count[n.id]
    for n in self.nodes:
      n.n_leaves = count[n.id]
      n.value = total[n.id] / count[n.id] if count[n.id] else None

  @property
  def mixed(self) -> bool:
    """Both a success (reward > 0.5) and a failure among the leaves."""
    r = [float(n.reward or 0.0) for n in self.leaves()]
    return bool(r) and min(r) <= 0.5 < max(r)

  # ---- serialization -----------------------------------------------------------------------------
  def to_dict(self) -> dict:
    nodes = []
    for n in self.nodes:
      d = dataclasses.asdict(n)
      d["feature"] = None if n.feature is None else np.asarray(n.feature, np.float32).tolist()
      nodes.append(d)
    return {"uid": self.uid, "meta": self.meta, "nodes": nodes}

  @classmethod
  def from_dict(cls, d: dict) -> "Tree":
    tree = cls([], uid=d["uid"], meta=d.get("meta"))  # (a "worker" key of older files: ignored)
    tree.nodes = []
    for nd in d["nodes"]:
      nd = dict(nd)
      if nd.get("feature") is not None:
        nd["feature"] = np.asarray(nd["feature"], np.float32)
      tree.nodes.append(Node(**nd))
    return tree

  def to_json(self) -> str:
    return json.dumps(self.to_dict())

  @classmethod
  def from_json(cls, s: str) -> "Tree":
    return cls.from_dict(json.loads(s))

  def __repr__(self):
    return (f"Tree(uid={self.uid}, nodes={len(self.nodes)}, leaves={len(self.leaves())}, "
            f"mixed={self.mixed})")


def save_trees(trees: Iterable[Tree], path: str) -> None:
  """One JSON object per line."""
  with open(path, "w") as f:
    for t in trees:
      f.write(t.to_json() + "\n")


def load_trees(path: str) -> list[Tree]:
  with open(path) as f:
    return [Tree.from_json(line) for line in f if line.strip()]


def to_flat(trees: Sequence[Tree], pad_to: int | None = None) -> dict[str, np.ndarray]:
  """Flat node arrays over all trees (parents before children), for `trace_jax.rl.advantages`.

  Runs `backup()` on each tree first. Returns numpy arrays over N nodes (N = pad_to if given):
    parent i32[N] (-1 for roots and padding), is_leaf bool[N], reward f32[N] (0 off leaves),
    tree i32[N] (index into `trees`), valid bool[N], plus node i32[N] (id within its tree),
    depth i32[N], value f32[N] (V(y), NaN if unknown), n_leaves i32[N], p_hat f32[N] (NaN if unset),
    num_gen_tokens i32[N], truncated bool[N].
  """
  rows: dict[str, list] = {k: [] for k in ("parent", "is_leaf", "reward", "tree", "valid", "node",
                                           "depth", "value", "n_leaves", "p_hat", "num_gen_tokens",
                                           "truncated")}
  offset = 0
  for ti, t in enumerate(trees):
    t.backup()
    for n in t.nodes:
      rows["parent"].append(n.parent + offset if n.parent >= 0 else -1)
      rows["is_leaf"].append(n.done)
      rows["reward"].append(float(n.reward) if n.done and n.reward is not None else 0.0)
      rows["tree"].append(ti)
      rows["valid"].append(True)
      rows["node"].append(n.id)
      rows["depth"].append(n.depth)
      rows["value"].append(np.nan if n.value is None else n.value)
      rows["n_leaves"].append(n.n_leaves)
      rows["p_hat"].append(np.nan if n.p_hat is None else n.p_hat)
      rows["num_gen_tokens"].append(len(n.gen_ids))
      rows["truncated"].append(bool(n.truncated))
    offset += len(t.nodes)
  if pad_to is not None:
    if pad_to < offset:
      raise ValueError(f"pad_to={pad_to} is smaller than the {offset} nodes")
    fill = {"parent": -1, "is_leaf": False, "reward": 0.0, "tree": 0, "valid": False, "node": -1,
            "depth": 0, "value": np.nan, "n_leaves": 0, "p_hat": np.nan, "num_gen_tokens": 0,
            "truncated": False}
    for k, v in fill.items():
      rows[k] += [v] * (pad_to - offset)
  dtypes = {"parent": np.int32, "is_leaf": bool, "reward": np.float32, "tree": np.int32,
            "valid": bool, "node": np.int32, "depth": np.int32, "value": np.float32,
            "n_leaves": np.int32, "p_hat": np.float32, "num_gen_tokens": np.int32,
            "truncated": bool}
  return {k: np.asarray(v, dtypes[k]) for k, v in rows.items()}


# ---- inspection ----------------------------------------------------------------------------------
def render_text(tree: Tree, max_chars: int = 60) -> str:
  """An indented outline: one line per node with depth, token counts, V and reward."""
  tree.backup()
  lines = [f"tree {tree.uid}: {len(tree.nodes)} nodes, {len(tree.leaves())} leaves"]

  def visit(nid, indent):
    n = tree.nodes[nid]
    v = "  -  " if n.value is None else f"{n.value:.2f}"
    tag = (f"leaf r={n.reward:.2f}" if n.done and n.reward is not None else
           ("leaf" if n.done else "anchor"))
    if n.truncated:
      tag += f" [{n.truncated}]"
    text = (n.text or n.obs_text).replace("\n", " ")[:max_chars]
    lines.append(f"{'  ' * indent}#{n.id} d={n.depth} gen={len(n.gen_ids)} obs={len(n.obs_ids)} "
                 f"V={v} n={n.n_leaves} {tag} | {text}")
    for c in n.children:
      visit(c, indent + 1)

  visit(0, 1)
  return "\n".join(lines)


def render_png(trees: Sequence[Tree], path: str, cols: int = 4) -> None:
  """Draws each tree (x = cumulative tokens, y = leaf order); green success, red failure leaves,
  black dots at anchors."""
  # A Figure of its own with the Agg canvas: the caller's pyplot backend (a notebook's inline one)
  # is left as it is.
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  rows = max(1, -(-len(trees) // cols))
  fig = Figure(figsize=(4 * min(cols, max(1, len(trees))), 3 * rows))
  FigureCanvasAgg(fig)
  axes = fig.subplots(rows, min(cols, max(1, len(trees))), squeeze=False)
  for ax in axes.flat:
    ax.axis("off")
  for ax, tree in zip(axes.flat, trees):
    ax.axis("on")
    tree.backup()
    x = {0: 0}
    for n in tree.nodes[1:]:
      x[n.id] = x[n.parent] + tree.nodes[n.parent].num_tokens
    y: dict[int, float] = {}
    counter = [0]

    def place(nid):
      n = tree.nodes[nid]
      if not n.children:
        y[nid] = counter[0]
        counter[0] += 1
      else:
        for c in n.children:
          place(c)
        y[nid] = float(np.mean([y[c] for c in n.children]))

    place(0)
    for n in tree.nodes[1:]:
      p = tree.nodes[n.parent]
      x0, x1 = x[p.id] + p.num_tokens, x[n.id] + n.num_tokens
      color = "0.5"
      if n.value is not None:
        color = "tab:green" if n.value > 0.5 else "tab:red"
      ax.plot([x0, x0, x1], [y[p.id], y[n.id], y[n.id]], color=color, lw=1.2)
      if n.done:
        ok = n.reward is not None and n.reward > 0.5
        ax.plot(x1, y[n.id], "o", color="tab:green" if ok else "tab:red", ms=5)
    for n in tree.anchors():
      ax.plot(x[n.id] + n.num_tokens, y[n.id], "ko", ms=3)
    ax.set_title(f"tree {tree.uid}: V={tree.root.value if tree.root.value is not None else 0:.2f}",
                 fontsize=9)
    ax.set_xlabel("tokens")
    ax.set_yticks([])
  fig.tight_layout()
  fig.savefig(path, dpi=100)


# Why a leaf ended that is the system's doing, not the policy's: the KV pool ran out
# ("pool_exhausted"), or the environment said so ("system:<reason>": a tool that failed its
# retries, a time-out). Such a leaf's reward says nothing of the policy.
SYSTEM_CUT_PREFIX = "system:"


def is_system_cut(node: Node) -> bool:
  """Whether `node` is a leaf the system ended (the pool, a failed tool, a time-out)."""
  return node.done and (node.truncated == "pool_exhausted"
                        or node.truncated.startswith(SYSTEM_CUT_PREFIX))


def system_cut_leaves(trees: Iterable[Tree]) -> int:
  """How many leaves of `trees` the system ended."""
  return sum(is_system_cut(n) for t in trees for n in t.nodes)


def without_system_cuts(tree: Tree) -> Tree | None:
  """`tree` without its system-cut leaves and every node only they descend from (ids renumbered,
  parents before children as before), so values, advantages, predictor targets and training see
  only outcomes the policy earned; None when no leaf is left. `tree` itself when it has none."""
  cut = [n.id for n in tree.nodes if is_system_cut(n)]
  if not cut:
    return tree
  keep = set()
  for leaf in tree.leaves():
    if not is_system_cut(leaf):
      keep.update(tree.path(leaf.id))
  if not keep:
    return None
  out = Tree(tree.prompt_ids, uid=tree.uid, meta=tree.meta)
  out.nodes, remap = [], {}
  for n in tree.nodes:
    if n.id in keep:
      remap[n.id] = len(out.nodes)
      out.nodes.append(dataclasses.replace(n, id=remap[n.id], parent=remap.get(n.parent, -1),
                                           children=[]))
      if n.parent >= 0:
        out.nodes[remap[n.parent]].children.append(remap[n.id])
  return out


__all__ = ["Node", "SYSTEM_CUT_PREFIX", "Tree", "is_system_cut", "load_trees", "render_png",
           "render_text", "save_trees", "system_cut_leaves", "to_flat", "without_system_cuts"]


def rollout_start_depths(tree) -> list[int]:
  """Per node, the depth of the anchor its rollout was started from (0: the root; -1 for the root
  itself). A rollout's nodes share `Node.rollout` (the sampler's branch serial); its first node is
  the one whose parent belongs to another rollout (or is the root). Hand-built trees without
  serials (-1 everywhere) count every turn as part of a rollout from the root."""
  start = [-1] * len(tree.nodes)
  for n in tree.nodes[1:]:  # parents come before children
    par = tree.nodes[n.parent]
    start[n.id] = par.depth if par.parent < 0 or par.rollout != n.rollout else start[par.id]
  return start


def rollout_values(tree, per_leaf: bool = False):
  """V(y) for the success predictor's targets, and how many leaves it counts, per node.

  Rule: a leaf counts for y when y lies on its rollout's own path and the rollout was not placed
  by looking at outcomes below y:
  - a rollout stage 1 started at the root counts for every node of its path, the root included;
  - a rollout stage 2 forked from an anchor h (a turn boundary; or the root, for a fresh draw
    into a tree whose stage-1 rollouts agreed, told apart by `Node.rollout` >=
    `tree.meta["stage1_rollouts"]` when the tree records it) counts only for the nodes it
    generated below h: not for h itself, nor above h.
  So a forked anchor's target is the outcome of the stage-1 rollout through it, never pooled with
  the continuations stage 2 placed there. Stage 2 picks h, and how many continuations it gets, by
  that outcome r (a continuation is worth most where r was surprising given p_hat); pooled into
  one target per node, r would weigh 1 where h was not picked and 1 / (k + 1) where it was, so
  E[target | h] != V(h). With V(h) = p_hat = 0.8 and k = 3 continuations wherever r = 0, the
  pooled target averages 0.92 over all anchors of that V, and dropping r for the continuations
  instead 0.96; r alone averages 0.8, as its weight no longer depends on the selection.
  Continuations are fresh draws at the nodes they generate, hence unbiased there; above h they
  sample a prefix picked by outcome. Trees without stage 2 (GRPO): `Tree.backup`'s V and n_y.

  per_leaf: also count a stage-2 rollout at the anchor it was forked from (the pooled mean over
  the leaves of rollouts started at y or above). Unbiased only for a fit that weighs every counted
  leaf as one observation (node weight n_y, the binomial likelihood), where r weighs 1 whether or
  not h was picked; a fit that weighs nodes alike must keep the default.

  Returns (values: list of float or None (no counted leaf), counts: list of int), per node.
  """
  start = rollout_start_depths(tree)
  stage1 = tree.meta.get("stage1_rollouts")
  total = [0.0] * len(tree.nodes)
  count = [0] * len(tree.nodes)
  for leaf in tree.leaves():
    r = float(leaf.reward or 0.0)
    top = start[leaf.id]  # the depth of the anchor its rollout started from
    placed = top > 0 or (stage1 is not None and 0 <= top and leaf.rollout >= int(stage1))
    if placed and not per_leaf:
      top += 1  # a stage-2 rollout: not for the anchor it was forked from
    n = leaf
    while n is not None and n.depth >= top:
      total[n.id] += r
      count[n.id] += 1
      n = tree.nodes[n.parent] if n.parent >= 0 else None
  return [t / c if c else None for t, c in zip(total, count)], count
