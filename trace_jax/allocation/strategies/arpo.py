"""ARPO: GRPO's roots with `root_budget`, then entropy-triggered branching after tool results;
trains with GRPO's advantage over the prompt's trajectories (a token shared by several gets the mean
of their advantages, ARPO's attribution, which `grpo_advantages` on the tree is)."""

from __future__ import annotations

import numpy as np

from trace_jax.allocation.strategies.base import Strategy, register, round_robin


@register
class Arpo(Strategy):
  name = "arpo"
  advantage = "grpo"

  def root_budget(self) -> int:
    return self.cfg.root_budget

  def spread(self, driver, trees, cands, n_cont):
    return arpo_counts(trees, cands, n_cont, self.cfg.max_per_anchor, self.cfg.arpo_entropy_top)


def entropy_rise(trees, cands) -> np.ndarray:
  """ARPO's Delta H per candidate: the entropy of the first token generated after the anchor's tool
  result minus the rollout's initial entropy (its first generated token). f32[H]."""

  def first_entropy(t, nid):
    n = t.nodes[t.nodes[nid].children[0]]
    return n.entropies[0] if n.entropies else 0.0

  def initial_entropy(t, nid):  # the first token of the rollout through nid
    n = t.nodes[t.path(nid)[1]]
    return n.entropies[0] if n.entropies else 0.0

  return np.asarray([first_entropy(trees[ti], nid) - initial_entropy(trees[ti], nid)
                     for ti, nid in cands], np.float32)


def arpo_counts(trees, cands, n_cont: int, cap: int, top_share: float) -> np.ndarray:
  """The top `top_share` of anchors by Delta H branch, the continuations spread over them
  round-robin in Delta H order, at most `cap` each; when those caps bind, the next anchors by
  Delta H take the rest. Returns i32[H]."""
  dh = entropy_rise(trees, cands)
  h = len(cands)
  n_anchor = max(1, int(round(top_share * h)))
  order = np.argsort(-dh, kind="stable")
  return round_robin(order, h, n_cont, cap, first=n_anchor)
