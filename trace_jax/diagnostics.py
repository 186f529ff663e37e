"""Diagnostics of the synthetic world's planted signal on sampled trees.

`prefix_signal` asks the question the method depends on: after a search that surfaced the
misleading passage of a trap hop, does the rest of the trajectory succeed less often than after a
search that surfaced the needed passage?
"""

from __future__ import annotations

import numpy as np


def _first_trap_hop(world, meta):
  for rel, subj in zip(meta["relations"], meta["chain"][:-1]):
    key = f"{rel}|{subj}"
    if key in world.traps:
      return world.needed_doc_id(rel, subj), set(world.traps[key])
  return None


def classify_rollout(tree, leaf_id, world) -> str | None:
  """'good' / 'bad' by the first observation showing the needed or a misleading passage of the
  question's first trap hop; None when the question has no trap hop or neither passage showed."""
  hop = _first_trap_hop(world, tree.meta.get("meta", {}))
  if hop is None:
    return None
  needed, wrong = hop
  for nid in tree.path(leaf_id)[1:]:
    obs = tree.nodes[nid].obs_text or ""
    if f"Title : {needed} )" in obs or f"Title: {needed})" in obs:
      return "good"
    if any(f"Title : {w} )" in obs or f"Title: {w})" in obs for w in wrong):
      return "bad"
  return None


def prefix_signal(trees, world) -> dict:
  """Success rate of rollouts after a good vs a misleading trap-hop search."""
  out = {"good": [], "bad": []}
  for t in trees:
    for leaf in t.leaves():
      cls = classify_rollout(t, leaf.id, world)
      if cls is not None:
        out[cls].append(float(leaf.reward or 0.0))
  g, b = out["good"], out["bad"]
  return dict(success_after_good=float(np.mean(g)) if g else float("nan"),
              success_after_bad=float(np.mean(b)) if b else float("nan"), n_good=len(g),
              n_bad=len(b), share_bad=len(b) / max(len(g) + len(b), 1))
