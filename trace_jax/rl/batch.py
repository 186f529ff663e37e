"""From sampled trees to the static-shape training batch of `trace_jax.rl.update`.

Every leaf gives one root-to-leaf sequence. Ownership is decided per sequence (the first sequence
that contains a node trains its tokens and its predictor target), then sequences are packed
first-fit into rows of `row_len` tokens with segment ids, so a short trajectory does not pay for a
long one's padding. The row count is rounded up to `row_multiple` so only a few shapes compile.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import numpy as np

from trace_jax.rl import advantages as adv_lib
from trace_jax.sampling.tree import rollout_values
from trace_jax.sampling.tree import Tree, to_flat

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
                    pred_leaf_weight: float = 0.0, values: str = "children"):
  """Per-leaf sequences with per-token mask/advantage/old log-prob and per-node predictor targets.

  Predictor targets are V(y) over the leaves of rollouts started at y or above
  (`predictor_fit.rollout_values`: stage-2 continuations forked below y were placed by looking at
  y's outcomes and would bias it); each node is weighted once (by the first sequence holding it),
  leaves by `pred_leaf_weight` (0: allocation never queries them).

  Returns (list of dicts, flat, node_adv). Each dict: tokens, mask (generated and owned), adv,
  old_logp (i.e. f32/i32 arrays [L]), prompt_len (its first prompt_len tokens are the prompt),
  pred_pos / pred_target / pred_weight ([nodes on the path]).
  """
  flat = to_flat(trees)
  adv = node_advantages(flat, kind, max_depth, normalize, values=values)
  seqs, offset, owned_tokens, owned_nodes = [], 0, set(), set()
  for t in trees:
    targets, _ = rollout_values(t)
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
        w.append(0.0 if (g in owned_nodes or v is None) else
                 (pred_leaf_weight if t.nodes[nid].done else 1.0))
        owned_nodes.add(g)
      seqs.append(dict(tokens=ids, mask=mask, adv=np.where(gen, adv[gid], 0.0).astype(np.float32),
                       old_logp=lps, prompt_len=len(t.prompt_ids),
                       pred_pos=np.asarray(pos, np.int32),
                       pred_target=np.asarray(tgt, np.float32),
                       pred_weight=np.asarray(w, np.float32)))
    offset += len(t.nodes)
  return seqs, flat, adv


def pack_batch(seqs: list[dict], row_len: int, preds_per_row: int, row_multiple: int = 8,
               min_rows: int = 0,
               num_rows: int | None = None) -> tuple[dict[str, np.ndarray], dict]:
  """First-fit packing (longest first) into [R, row_len] rows; see trace_jax.rl.update's layout.

  Sequences longer than `row_len` are cut (their cut tokens untrained); counted in the info.
  With `num_rows`, R is fixed (one compiled update shape for the whole run); sequences that do not
  fit are left out and counted in `dropped_sequences` (size num_rows so that this stays rare).
  """
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
  for r, members in enumerate(rows):
    at = ap = 0
    for s, i in enumerate(members, start=1):
      q = seqs[i]
      L = min(len(q["tokens"]), row_len)
      sl = slice(at, at + L)
      b["tokens"][r, sl] = q["tokens"][:L]
      b["segment_ids"][r, sl] = s
      b["positions"][r, sl] = np.arange(L)
      for k in ("mask", "adv", "old_logp"):
        b[k][r, sl] = q[k][:L]
      b["mask"][r, at] = 0.0  # the first token of a segment has no context in this row
      keep = q["pred_pos"] < L
      P = int(keep.sum())
      b["pred_pos"][r, ap:ap + P] = q["pred_pos"][keep] + at
      b["pred_target"][r, ap:ap + P] = q["pred_target"][keep]
      b["pred_weight"][r, ap:ap + P] = q["pred_weight"][keep]
      b["pred_pstart"][r, ap:ap + P] = at  # the segment's prompt, for prompt-mean features
      b["pred_plen"][r, ap:ap + P] = min(int(q.get("prompt_len", 0)), L)
      at += L
      ap += P
  info = dict(rows=len(rows), padded_rows=n_rows, sequences=len(seqs), cut_sequences=cut,
              dropped_sequences=dropped,
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


__all__ = ["ADVANTAGES", "build_sequences", "node_advantages", "pack_batch",
           "tree_metrics"]
