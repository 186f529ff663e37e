"""From sampled trees to the training batch of `trace_jax.rl.update`, in one of two layouts.

`rl.packing=none` (`build_sequences`): every leaf gives one root-to-leaf sequence. Ownership is
decided per sequence (the first sequence that contains a node trains its tokens and its predictor
target), so a shared segment is *trained* once but *computed* once per leaf through it.

`rl.packing=tree` (`build_tree_units`): each tree is laid out with every node's tokens once, in
preorder, split into as few units of at most `row_len` tokens as its leaves allow (a unit is a
union of root-to-leaf paths; only the ancestors of a unit's first leaf are repeated in the next).
Each token carries its depth along its own root path (`positions`, so RoPE is what the unpacked
sequence would give), the row index its logits are read from (`prev`: the previous token on its
root path, the parent's last token for a node's first) and the end of its node's subtree
(`kv_end`: a key is seen by queries up to there, so every token attends exactly to its ancestors
and its own node's causal past). Every node's tokens and predictor target are trained once, with
the same advantage, old log-prob and normalizer as in the unpacked layout: the packed loss and
gradients are the unpacked ones (tests/test_tree_packing.py), computed on fewer tokens.

Either kind of unit is packed first-fit into rows of `row_len` tokens (`pack_batch`), so a short
trajectory does not pay for a long one's padding; the row count is rounded up to `row_multiple`
(or to one of a few `row_buckets`) so only a few shapes compile.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import numpy as np

from trace_jax.allocation.holdout import held_out
from trace_jax.rl import advantages as adv_lib
from trace_jax.sampling.tree import rollout_values
from trace_jax.sampling.tree import Tree, to_flat

PACKINGS = ("tree", "none")  # rl.packing: each tree's nodes once per unit | one row per leaf

ADVANTAGES = {
    "tree_contrastive": adv_lib.tree_contrastive_advantages,
    "grpo": adv_lib.grpo_advantages,
    "tree_grpo": adv_lib.tree_grpo_advantages,
    "treerl": adv_lib.treerl_advantages,
}


@functools.lru_cache(maxsize=None)
def _jitted(kind: str, max_depth: int, normalize: bool, values: str):
  kw = {"normalize": normalize} if kind != "treerl" else {}
  if kind != "grpo":  # GRPO's baseline is the group's leaf mean by definition.
    kw["values"] = values
  return jax.jit(lambda p, l, r, t, v: ADVANTAGES[kind](p, l, r, t, v, max_depth, **kw))


def node_advantages(flat: dict, kind: str, max_depth: int, normalize: bool = True,
                    bucket: int = 256, values: str = "children") -> np.ndarray:
  """Per-node advantages f32[N] of the flat trees with the named estimator.

  `values` names the estimator of V at branch points (`advantages.backup_values`: "children", the
  unbiased child mean, or "leaves"); GRPO ignores it. The node arrays are padded to a multiple of
  `bucket` (invalid nodes) so the jitted estimator compiles once per bucket, not once per step."""
  if kind not in ADVANTAGES:
    raise ValueError(f"unknown advantage {kind!r}; choose one of {sorted(ADVANTAGES)}")
  if values not in adv_lib.VALUE_ESTIMATORS:
    raise ValueError(f"unknown value estimator {values!r}; choose one of "
                     f"{adv_lib.VALUE_ESTIMATORS}")
  n = len(flat["parent"])
  pad = -(-max(n, 1) // bucket) * bucket - n
  args = [np.concatenate([flat[k], np.full(pad, fill, flat[k].dtype)]) for k, fill in
          (("parent", -1), ("is_leaf", False), ("reward", 0.0), ("tree", 0), ("valid", False))]
  return np.asarray(_jitted(kind, max_depth, normalize, values)(*args))[:n]


def build_sequences(trees: Sequence[Tree], kind: str, max_depth: int, normalize: bool = True,
                    pred_leaf_weight: float = 0.0, values: str = "children",
                    pred_holdout: float = 0.0):
  """Per-leaf sequences with per-token mask/advantage/old log-prob and per-node predictor targets.

  Predictor targets are `sampling.tree.rollout_values`' (one target per node: a stage-2 continuation
  counts only for the nodes it generated, never for its anchor or above, which were chosen by
  looking at outcomes it would bias); each node is weighted once (by the first sequence holding it),
  leaves by `pred_leaf_weight` (0: allocation never queries them). The nodes of a prompt the
  predictor's fit holds out (`pred_holdout`, the share `rl.predictor_holdout`; `holdout.held_out`)
  weigh 0, so the joint update never trains the head on what the fit early-stops on.

  Returns (list of dicts, flat, node_adv). Each dict: tokens, mask (generated and owned), adv,
  old_logp (i.e. f32/i32 arrays [L]), prompt_len (its first prompt_len tokens are the prompt),
  pred_pos / pred_target / pred_weight ([nodes on the path]).
  """
  flat = to_flat(trees)
  adv = node_advantages(flat, kind, max_depth, normalize, values=values)
  seqs, offset, owned_tokens, owned_nodes = [], 0, set(), set()
  for t in trees:
    targets, _ = rollout_values(t)
    hold = held_out(t.prompt_ids, pred_holdout)
    for leaf in t.leaves():
      ids, gen, owner, lps = t.path_tokens(leaf.id)
      gid = owner + offset
      mask = np.zeros(len(ids), np.float32)
      for nid in set(gid[gen].tolist()):
        if nid not in owned_tokens:
          owned_tokens.add(nid)
          mask[gen & (gid == nid)] = 1.0
      pos, tgt, w = [], [], []
      end = 0
      for nid in t.path(leaf.id):
        end += t.nodes[nid].num_tokens
        g = nid + offset
        v = targets[nid]
        pos.append(max(end - 1, 0))
        tgt.append(0.0 if v is None else float(v))
        w.append(0.0 if (g in owned_nodes or v is None or hold) else
                 (pred_leaf_weight if t.nodes[nid].done else 1.0))
        owned_nodes.add(g)
      seqs.append(dict(tokens=ids, mask=mask, adv=np.where(gen, adv[gid], 0.0).astype(np.float32),
                       old_logp=lps, prompt_len=len(t.prompt_ids),
                       pred_pos=np.asarray(pos, np.int32),
                       pred_target=np.asarray(tgt, np.float32),
                       pred_weight=np.asarray(w, np.float32)))
    offset += len(t.nodes)
  return seqs, flat, adv


def _preorder(t: Tree, nodes: set) -> list[int]:
  """The nodes of `nodes` (a prefix-closed set of `t`'s ids) in preorder, children in id order."""
  out, stack = [], [0]
  while stack:
    nid = stack.pop()
    out.append(nid)
    stack += [c for c in reversed(t.nodes[nid].children) if c in nodes]
  return out


def build_tree_units(trees: Sequence[Tree], kind: str, max_depth: int, row_len: int,
                     max_nodes: int, normalize: bool = True, pred_leaf_weight: float = 0.0,
                     values: str = "children", cut_len: int | None = None,
                     pred_holdout: float = 0.0):
  """Tree-packed units (`rl.packing=tree`, see the module docstring): the same trained tokens,
  advantages, old log-probs and predictor targets as `build_sequences`, each node's tokens once
  per unit. A unit fills one row of `row_len` tokens and may hold parts of several trees.

  Leaves are placed one at a time (trees largest first, each tree's leaves in preorder) into the
  unit where they add the fewest tokens (the nodes of their root path the unit does not hold yet
  for that tree), ties to the fullest unit, within `row_len` tokens and `max_nodes` nodes; a new
  unit is opened when none fits. So a tree stays whole when it fits a row, and a split tree
  repeats only the ancestors its later units need (computed again there, trained once). A path
  longer than `cut_len` (default `row_len`; at most `row_len`) is cut there, as `pack_batch` cuts
  a sequence longer than its rows: the cut tokens are untrained in both layouts when `cut_len` is
  the unpacked row length. A `row_len` above it holds whole trees that one path's row cannot.
  Predictor entries are emitted only where they are weighted (a node's first unit), one per node;
  a prompt the predictor's fit holds out (`pred_holdout`, as in `build_sequences`) has none.

  Returns (list of unit dicts, flat, node_adv). A unit dict has the fields of a `build_sequences`
  sequence (tokens, mask, adv, old_logp, pred_pos, pred_target, pred_weight) plus positions, prev
  and kv_end (i32[L], indices within the unit), pred_pstart / pred_plen (each entry's prompt
  within the unit) and `leaves`, its leaf count.
  """
  flat = to_flat(trees)
  adv = node_advantages(flat, kind, max_depth, normalize, values=values)
  cut = row_len if cut_len is None else min(int(cut_len), row_len)
  info, offset = [], 0
  for t in trees:
    start = [0] * len(t.nodes)  # depth position of each node's first token on its root path
    for n in t.nodes[1:]:
      start[n.id] = start[n.parent] + t.nodes[n.parent].num_tokens
    clip = [max(min(n.num_tokens, cut - start[n.id]), 0) for n in t.nodes]
    leaves = [nid for nid in _preorder(t, set(range(len(t.nodes)))) if t.nodes[nid].done]
    paths = [[nid for nid in t.path(leaf) if start[nid] < cut or nid == 0] for leaf in leaves]
    size = sum(clip[i] for i in set().union(*paths)) if paths else 0
    info.append((t, offset, start, clip, paths, size))
    offset += len(t.nodes)

  # Placement: per unit, its token count, node count, {tree index: node set} and leaf count.
  units_at: list[list] = []
  for ti in sorted(range(len(info)), key=lambda i: -info[i][5]):
    t, _, _, clip, paths, _ = info[ti]
    for path in paths:
      best = None
      for ui, (used, count, held, _) in enumerate(units_at):
        have = held.get(ti, ())
        new = [nid for nid in path if nid not in have]
        add = sum(clip[nid] for nid in new)
        if used + add <= row_len and count + len(new) <= max_nodes:
          key = (add, row_len - used - add)
          if best is None or key < best[0]:
            best = (key, ui, new, add)
      if best is None:
        units_at.append([0, 0, {}, 0])
        best = (None, len(units_at) - 1, path, sum(clip[nid] for nid in path))
      _, ui, new, add = best
      units_at[ui][0] += add
      units_at[ui][1] += len(new)
      units_at[ui][2].setdefault(ti, set()).update(new)
      units_at[ui][3] += 1

  owned: set = set()  # (tree index, node id): trained in the first unit that holds it
  units = []
  for used, _, held, n_leaves in units_at:
    u = dict(tokens=np.zeros(used, np.int32), mask=np.zeros(used, np.float32),
             adv=np.zeros(used, np.float32), old_logp=np.zeros(used, np.float32),
             positions=np.zeros(used, np.int32), prev=np.zeros(used, np.int32),
             kv_end=np.zeros(used, np.int32), leaves=n_leaves)
    preds = {k: [] for k in ("pred_pos", "pred_target", "pred_weight", "pred_pstart",
                             "pred_plen")}
    at = 0
    for ti, nodes in held.items():
      t, toff, start, clip, _, _ = info[ti]
      targets, _ = rollout_values(t)
      hold = held_out(t.prompt_ids, pred_holdout)
      order = _preorder(t, nodes)
      first, last, base = {}, {}, at
      for nid in order:
        first[nid], at = at, at + clip[nid]
        last[nid] = at - 1 if clip[nid] else (last[t.nodes[nid].parent] if nid else base)
      end = {nid: first[nid] + clip[nid] for nid in order}  # subtree ends, leaves up
      for nid in reversed(order):
        if nid:
          par = t.nodes[nid].parent
          end[par] = max(end[par], end[nid])
      for nid in order:
        n, k, a = t.nodes[nid], clip[nid], first[nid]
        if k:
          sl = slice(a, a + k)
          gen = np.arange(k) < len(n.gen_ids)
          u["tokens"][sl] = (n.gen_ids + n.obs_ids)[:k]
          u["old_logp"][sl] = np.where(gen, np.asarray(list(n.logprobs) + [0.0] * len(n.obs_ids),
                                                       np.float32)[:k], 0.0)
          u["adv"][sl] = np.where(gen, adv[nid + toff], 0.0)
          if (ti, nid) not in owned:
            u["mask"][sl] = gen
          u["positions"][sl] = start[nid] + np.arange(k)
          u["prev"][sl] = np.arange(a - 1, a + k - 1)
          u["prev"][a] = last[n.parent] if nid else a
          u["kv_end"][sl] = end[nid]
        v = targets[nid]
        wt = 0.0 if hold else (pred_leaf_weight if n.done else 1.0)
        if ((ti, nid) not in owned and v is not None and start[nid] + n.num_tokens <= cut
            and wt > 0):
          for key, val in zip(preds, (last[nid], float(v), wt, base,
                                      min(len(t.prompt_ids), cut))):
            preds[key].append(val)
        owned.add((ti, nid))
    for key, vals in preds.items():
      u[key] = np.asarray(vals, np.float32 if key in ("pred_target", "pred_weight") else np.int32)
    units.append(u)
  return units, flat, adv


def row_buckets(cap: int, multiple: int) -> list[int]:
  """The compiled row counts of tree-packed updates: every multiple of `multiple` (micro-batches
  x shards x minibatches) up to 16 of them, then steps of about 1/8, and `cap` itself (rounded up
  to the multiple). A batch pads at most one multiple (or an eighth) of rows, and since a run's
  batches vary by a few rows it compiles a handful of shapes.
  80 rows in multiples of 4 -> [4, 8, ..., 60, 64, 72, 80]."""
  cap = -(-max(int(cap), 1) // multiple) * multiple
  out, k = [], 1
  while k * multiple < cap:
    out.append(k * multiple)
    k = k + 1 if k < 16 else max(k + 1, -(-k * 9 // 8))
  return out + [cap]


def pack_batch(seqs: list[dict], row_len: int, preds_per_row: int, row_multiple: int = 8,
               min_rows: int = 0, num_rows: int | None = None,
               buckets: Sequence[int] | None = None) -> tuple[dict[str, np.ndarray], dict]:
  """First-fit packing (longest first) into [R, row_len] rows; see trace_jax.rl.update's layout.

  `seqs` are `build_sequences` sequences or `build_tree_units` units (then the batch also holds
  `prev` and `kv_end`, offset to row indices, and each unit's own `positions`).
  Sequences longer than `row_len` are cut (their cut tokens untrained); counted in the info.
  With `num_rows`, R is fixed (one compiled update shape for the whole run); sequences that do not
  fit are left out and counted in `dropped_sequences` (size num_rows so that this stays rare).
  With `buckets` (ascending row counts, e.g. `row_buckets`), R is the smallest bucket that holds
  every row, or the last one (the rest dropped and counted).
  """
  tree = any("kv_end" in q for q in seqs)
  order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]["tokens"]))
  rows, fill, npred = [], [], []
  cut = 0
  for i in order:
    L = min(len(seqs[i]["tokens"]), row_len)
    cut += len(seqs[i]["tokens"]) > row_len
    P = len(seqs[i]["pred_pos"])
    for r in range(len(rows)):
      if fill[r] + L <= row_len and npred[r] + P <= preds_per_row:
        rows[r].append(i)
        fill[r] += L
        npred[r] += P
        break
    else:
      if P > preds_per_row:
        raise ValueError(f"a sequence has {P} nodes, more than preds_per_row={preds_per_row}")
      rows.append([i])
      fill.append(L)
      npred.append(P)
  dropped = 0
  if buckets is not None:
    num_rows = next((b for b in buckets if b >= len(rows)), buckets[-1])
  if num_rows is not None:
    dropped = sum(len(r) for r in rows[num_rows:])
    rows, fill = rows[:num_rows], fill[:num_rows]
    n_rows = num_rows
  else:
    n_rows = max(-(-max(len(rows), 1) // row_multiple) * row_multiple, min_rows)
  z = lambda dt: np.zeros((n_rows, row_len), dt)  # noqa: E731
  b = dict(tokens=z(np.int32), segment_ids=z(np.int32), positions=z(np.int32),
           mask=z(np.float32), adv=z(np.float32), old_logp=z(np.float32), ref_logp=z(np.float32),
           pred_pos=np.zeros((n_rows, preds_per_row), np.int32),
           pred_target=np.zeros((n_rows, preds_per_row), np.float32),
           pred_weight=np.zeros((n_rows, preds_per_row), np.float32),
           pred_pstart=np.zeros((n_rows, preds_per_row), np.int32),
           pred_plen=np.zeros((n_rows, preds_per_row), np.int32))
  if tree:  # padding attends to itself only
    b["prev"] = np.tile(np.arange(row_len, dtype=np.int32), (n_rows, 1))
    b["kv_end"] = b["prev"] + 1
  for r, members in enumerate(rows):
    at = ap = 0
    for s, i in enumerate(members, start=1):
      q = seqs[i]
      L = min(len(q["tokens"]), row_len)
      sl = slice(at, at + L)
      b["tokens"][r, sl] = q["tokens"][:L]
      b["segment_ids"][r, sl] = s
      if tree:
        b["positions"][r, sl] = q["positions"][:L]
        b["prev"][r, sl] = q["prev"] + at  # a unit is never longer than a row
        b["kv_end"][r, sl] = q["kv_end"] + at
      else:
        b["positions"][r, sl] = np.arange(L)
      for k in ("mask", "adv", "old_logp"):
        b[k][r, sl] = q[k][:L]
      b["mask"][r, at] = 0.0  # the first token of a segment has no context in this row
      keep = q["pred_pos"] < L
      P = int(keep.sum())
      b["pred_pos"][r, ap:ap + P] = q["pred_pos"][keep] + at
      b["pred_target"][r, ap:ap + P] = q["pred_target"][keep]
      b["pred_weight"][r, ap:ap + P] = q["pred_weight"][keep]
      if "pred_pstart" in q:  # a unit: each entry's own tree's prompt
        b["pred_pstart"][r, ap:ap + P] = q["pred_pstart"][keep] + at
        b["pred_plen"][r, ap:ap + P] = q["pred_plen"][keep]
      else:  # the segment's prompt, for prompt-mean features
        b["pred_pstart"][r, ap:ap + P] = at
        b["pred_plen"][r, ap:ap + P] = min(int(q.get("prompt_len", 0)), L)
      at += L
      ap += P
  info = dict(rows=len(rows), padded_rows=n_rows, sequences=len(seqs), cut_sequences=cut,
              dropped_sequences=dropped, tokens=float(sum(fill)),
              fill=float(sum(fill)) / (n_rows * row_len),
              trained_tokens=float(b["mask"].sum()))
  return b, info


def random_batch(rows: int, seq: int, vocab: int, preds: int = 16, seed: int = 0,
                 mask_rate: float = 0.6, old_logp: float = -4.5) -> dict[str, np.ndarray]:
  """A random batch in the update's layout (`trace_jax.rl.update`), for benchmarks and tests:
  one unpacked sequence per row, a `mask_rate` share of tokens trained (never the first),
  Gaussian advantages, a constant old log-prob and `preds` predictor targets per row."""
  rs = np.random.RandomState(seed)
  mask = (rs.rand(rows, seq) < mask_rate).astype(np.float32)
  mask[:, 0] = 0
  return {"tokens": rs.randint(0, vocab, (rows, seq)).astype(np.int32),
          "segment_ids": np.ones((rows, seq), np.int32),
          "positions": np.tile(np.arange(seq, dtype=np.int32), (rows, 1)), "mask": mask,
          "adv": rs.randn(rows, seq).astype(np.float32),
          "old_logp": np.full((rows, seq), old_logp, np.float32),
          "ref_logp": np.zeros((rows, seq), np.float32),
          "pred_pos": rs.randint(0, seq, (rows, preds)).astype(np.int32),
          "pred_target": rs.rand(rows, preds).astype(np.float32),
          "pred_weight": np.ones((rows, preds), np.float32)}


def tree_metrics(trees: Sequence[Tree]) -> dict:
  """Effective ratio (mixed trees), mean reward, leaves and nodes per tree."""
  if not trees:
    return dict(effective_ratio=float("nan"), reward_mean=float("nan"), leaves=0)
  rewards = [float(n.reward or 0.0) for t in trees for n in t.leaves()]
  return dict(effective_ratio=float(np.mean([t.mixed for t in trees])),
              reward_mean=float(np.mean(rewards)) if rewards else float("nan"),
              leaves=len(rewards), leaves_per_tree=len(rewards) / len(trees),
              nodes_per_tree=float(np.mean([len(t.nodes) for t in trees])))


__all__ = ["ADVANTAGES", "PACKINGS", "build_sequences", "build_tree_units", "node_advantages",
           "pack_batch", "row_buckets", "tree_metrics"]
