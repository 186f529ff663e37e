"""Extra fitting of the success predictor on the sampler's own prefix features.

The joint update (`rl/update.py`) takes one predictor step per RL step, which is far too few for
the head to learn anything in a short run: measured on the warm-started tiny policy, 30 such steps
left its allocation-time AUC at 0.52, while the same head fit for a few hundred steps on one
batch of
rollouts reached 0.81 held out. So after each RL step the head also takes `steps` full-batch
steps on a small replay buffer of recent (feature, V(y)) pairs. Features are the final hidden
states the sampler recorded at each prefix end (what allocation reads), so no extra forward pass.

Targets. V(y) here counts only the leaves of rollouts that started at y or above it
(`rollout_values`): a continuation stage 2 forked from below y was placed there *because* of the
outcomes already seen in y's subtree (to flip them), so averaging it into V(y) would pull the
target of the most extreme prompts toward 0.5. Visit weighting weighs a node by the leaves it
counts, so each counted leaf is one Bernoulli observation. Leaves (finished trajectories) are never
queried at allocation; they get `leaf_weight` (0 by default), so the fit spends itself on the roots
and turn boundaries allocation reads.

Optimizer state. The fitter keeps its own optax state (`state_dict` / `load_state_dict` for
checkpoints): its weighted full-batch fit and the joint update's per-step fit are two objectives,
and one Adam state shared between them would carry each one's moments into the other.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from trace_jax.rl.losses import predictor_bce
from trace_jax.sampling.tree import rollout_values

_OWN = object()  # `fit` without an opt_state argument: the fitter's own state


def node_examples(trees, with_meta: bool = False):
  """(features f32[n, D], targets V(y) f32[n]) of every node with a recorded feature and a value,
  V(y) from `rollout_values`; with `with_meta` also those nodes' counted leaves n_y f32[n], a root
  mask bool[n] and a leaf mask bool[n]."""
  feats, vals, counts, roots, leaves = [], [], [], [], []
  for t in trees:
    t.backup()  # callers read node.value / n_leaves as well (the full subtree's)
    values, n_leaves = rollout_values(t)
    for n in t.nodes:
      if n.feature is not None and values[n.id] is not None:
        feats.append(np.asarray(n.feature, np.float32))
        vals.append(float(values[n.id]))
        counts.append(float(n_leaves[n.id]))
        roots.append(n.parent < 0)
        leaves.append(n.done)
  if not feats:
    out = (np.zeros((0, 0), np.float32), np.zeros((0,), np.float32))
  else:
    out = (np.stack(feats), np.asarray(vals, np.float32))
  if with_meta:
    return (*out, np.asarray(counts, np.float32), np.asarray(roots, bool),
            np.asarray(leaves, bool))
  return out


@functools.lru_cache(maxsize=8)
def _fit_fn(pred_graphdef, tx, steps: int):
  def fit(pred_state, opt_state, x, y, w):
    def one(carry, _):
      s, o = carry
      loss, g = jax.value_and_grad(
          lambda q: predictor_bce(nnx.merge(pred_graphdef, q)(x), y, w))(s)
      u, o = tx.update(g, o, s)
      return (optax.apply_updates(s, u), o), loss
    (s, o), losses = jax.lax.scan(one, (pred_state, opt_state), None, length=steps)
    return s, o, losses[0], losses[-1]
  return jax.jit(fit)


class PredictorFitter:
  """Keeps the last `buffer_steps` batches of node examples and fits the head on all of them.

  `weighting`: "uniform" (every node alike) or "visits" (each node by its counted leaves n_y, so a
  root counts as much as all its rollouts together: the prefixes allocation reads first weigh most).
  `leaf_weight`: multiplies the weight of leaves (finished trajectories, never queried at
  allocation); 0 leaves them out of the fit.
  `root_buffer_steps`: root nodes are one per prompt, a few dozen per step, so they may be kept for
  more steps than the other nodes (default: as many).
  `root_features`: optional prompts -> f32[N, D] (the engine's `prompt_features`). When given, the
  buffered roots are re-featurized under the current policy before every fit, so stage 1, which
  reads root features of the current policy, is fit on features of that same policy rather than
  of the policies that sampled them (a prompt is one cheap prefill).
  `pred_state`: the head's parameters, to create the fitter's own optimizer state now (otherwise
  at the first fit); `state_dict()` / `load_state_dict(d)` save and restore it.
  """

  def __init__(self, pred_graphdef, tx, steps: int = 50, buffer_steps: int = 4,
               max_rows: int = 8192, bucket: int = 1024, seed: int = 0,
               weighting: str = "uniform", root_buffer_steps: int | None = None,
               root_features=None, leaf_weight: float = 0.0, pred_state=None):
    if weighting not in ("uniform", "visits"):
      raise ValueError(f"weighting must be 'uniform' or 'visits', got {weighting!r}")
    self.graphdef, self.tx, self.steps, self.weighting = pred_graphdef, tx, steps, weighting
    self.buffer = collections.deque(maxlen=buffer_steps)
    self.roots = collections.deque(maxlen=max(root_buffer_steps or buffer_steps, buffer_steps))
    self.max_rows, self.bucket = max_rows, bucket
    self.root_features = root_features
    self.rng = np.random.default_rng(seed)
    self.leaf_weight = float(leaf_weight)
    self.opt_state = None if pred_state is None else tx.init(pred_state)

  # ---- the fitter's own optimizer state ----------------------------------------------------------
  def init(self, pred_state) -> None:
    """Creates a fresh optimizer state for the head's parameters `pred_state`."""
    self.opt_state = self.tx.init(pred_state)

  def state_dict(self) -> dict:
    """The fitter's optimizer state, a pytree of arrays (for a checkpoint). Call `init` or pass
    `pred_state` to the constructor first, so a fresh fitter has the structure to restore into."""
    if self.opt_state is None:
      raise ValueError("the fitter has no optimizer state yet: call init(pred_state) first")
    return {"opt_state": self.opt_state}

  def load_state_dict(self, d: dict) -> None:
    """Restores what `state_dict` returned."""
    self.opt_state = d["opt_state"]

  # ---- data and fit ------------------------------------------------------------------------------
  def add(self, trees) -> int:
    x, y, n, root, leaf = node_examples(trees, with_meta=True)
    if len(y):
      w = n if self.weighting == "visits" else np.ones_like(y)
      w = np.where(leaf, w * self.leaf_weight, w).astype(np.float32)
      self.buffer.append((x[~root], y[~root], w[~root], leaf[~root]))
      prompts = [t.prompt_ids for t in trees
                 if t.root.feature is not None and t.root.value is not None]
      self.roots.append((x[root], y[root], w[root], prompts))
    return len(y)

  def fit(self, pred_state, opt_state=_OWN, steps: int | None = None):
    """`steps` full-batch steps on the buffer with the fitter's own optimizer state.

    Returns (pred_state, info). The older call `fit(pred_state, opt_state, steps)` still works and
    returns (pred_state, opt_state, info) with `opt_state` (the joint update's) passed through
    untouched: the fitter never steps it.
    """
    legacy = opt_state is not _OWN
    done = (lambda ps, info: (ps, opt_state, info)) if legacy else (lambda ps, info: (ps, info))
    if self.opt_state is None:
      self.init(pred_state)
    if not self.buffer:
      return done(pred_state, {})
    roots = list(self.roots)
    if self.root_features is not None and any(len(r[3]) for r in roots):
      fresh = np.asarray(self.root_features([p for r in roots for p in r[3]]), np.float32)
      splits = np.cumsum([len(r[3]) for r in roots])[:-1]
      roots = [(f, *r[1:]) for f, r in zip(np.split(fresh, splits), roots)]
    parts = [*self.buffer, *roots]
    x = np.concatenate([b[0] for b in parts])
    y = np.concatenate([b[1] for b in parts])
    w = np.concatenate([b[2] for b in parts])
    leaf = np.concatenate([b[3] for b in self.buffer] + [np.zeros(len(r[1]), bool) for r in roots])
    is_root = np.concatenate([np.zeros(len(b[1]), bool) for b in self.buffer] +
                             [np.ones(len(r[1]), bool) for r in roots])
    keep = w > 0  # rows without weight (leaves, by default) would only take room
    x, y, w, leaf, is_root = x[keep], y[keep], w[keep], leaf[keep], is_root[keep]
    if len(y) > self.max_rows:
      keep = self.rng.choice(len(y), self.max_rows, replace=False)
      x, y, w, leaf, is_root = x[keep], y[keep], w[keep], leaf[keep], is_root[keep]
    if not len(y):
      return done(pred_state, {})
    n = len(y)
    rows = -(-n // self.bucket) * self.bucket  # few shapes, few compiles
    xp = np.zeros((rows, x.shape[1]), np.float32)
    yp = np.zeros(rows, np.float32)
    wp = np.zeros(rows, np.float32)
    xp[:n], yp[:n], wp[:n] = x, y, w
    fit = _fit_fn(self.graphdef, self.tx, int(steps or self.steps))
    pred_state, self.opt_state, first, last = fit(pred_state, self.opt_state, jnp.asarray(xp),
                                                  jnp.asarray(yp), jnp.asarray(wp))
    # Share of the fit's weight on roots and on leaves (the rest: turn boundaries).
    total = float(w.sum())
    return done(pred_state, dict(predictor_fit_rows=n, predictor_fit_bce_first=float(first),
                                 predictor_fit_bce_last=float(last),
                                 predictor_fit_leaf_weight_share=float(w[leaf].sum()) / total,
                                 predictor_fit_root_weight_share=float(w[is_root].sum()) / total))
