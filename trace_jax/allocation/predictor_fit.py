"""Extra fitting of the success predictor on the sampler's own prefix features.

The joint update (`rl/update.py`) takes one predictor step per RL step, which is far too few for
the head to learn anything in a short run: measured on the warm-started tiny policy, 30 such steps
left its allocation-time AUC at 0.52, while the same head fit for a few hundred steps on one
batch of
rollouts reached 0.81 held out. So after each RL step the head also takes `steps` full-batch
steps on a small replay buffer of recent (feature, V(y)) pairs. Features are the final hidden
states the sampler recorded at each prefix end (what allocation reads), so no extra forward pass.

Targets (`rollout_values`). A continuation stage 2 forked from below y was placed there *because*
of the outcomes already seen in y's subtree (to flip them), so it never counts for the nodes above
its anchor. At a forked anchor itself the rule depends on the weighting: with visit weighting
(each counted leaf one Bernoulli observation) the anchor's target pools the stage-1 outcome that
chose it with the continuations (`per_leaf=True`), which is unbiased under that weighting; with
uniform weighting (one target per node, as the joint update reads them) pooling would weigh the
selecting outcome by whether it was selected, so the anchor's target is the outcome of the stage-1
rollout through it alone. Leaves (finished trajectories) are never
queried at allocation; they get `leaf_weight` (0 by default), so the fit spends itself on the roots
and turn boundaries allocation reads.

Likelihood. With visit weighting (a node weighs its counted leaves n_y) the weighted BCE of target
V(y) is exactly the binomial log-likelihood of the node's k_y = n_y V(y) successes in n_y
outcomes, up to a constant: a root with 8 rollouts is 8 Bernoulli observations of one p, a turn
prefix with one continuation is one. Nothing is double counted; turn prefixes weigh much of the
fit because there are many of them, each with its own p.

Held-out prompts and early stopping (`holdout` > 0). A fixed share of prompts (by a hash of their
token ids, so a prompt is always on the same side) is kept out of the fit; each fit step also
scores the held-out rows, and the fit returns the parameters of the step with the lowest held-out
loss (the first step's input counts as a candidate, so a fit that only hurts changes nothing).

Ensemble (`ensemble` = K > 1; K = 2 is refused). K - 1 member heads live in the fitter beside the
model's head; each fit steps every member on its own bootstrap (Poisson(1) weights per row, drawn
anew per fit) of the same rows, with its own optimizer state. `spread(pred_state, features)`
returns the mean and variance of p̂ over the K - 1 members: the disagreement of heads fit alike on
resampled data, a standard estimate of how far the fit's p̂ can be from what more data would give.
The model's head is left out of it: the joint update also trains it, so it differs from the
members by a systematic gap that is no sampling uncertainty (`spread`). Stage 1 turns the spread
into a Beta concentration (`allocators.concentration_from_spread`).

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

from trace_jax.allocation.holdout import held_out
from trace_jax.allocation.predictor_loss import predictor_bce
from trace_jax.sampling.tree import rollout_values

_OWN = object()  # `fit` without an opt_state argument: the fitter's own state


def node_examples(trees, with_meta: bool = False, per_leaf: bool = False):
  """(features f32[n, D], targets V(y) f32[n]) of every node with a recorded feature and a value,
  V(y) from `rollout_values` (`per_leaf`: pooled at forked anchors, for visit weighting); with
  `with_meta` also those nodes' counted leaves n_y f32[n], a root mask bool[n] and a leaf mask
  bool[n]."""
  feats, vals, counts, roots, leaves = [], [], [], [], []
  for t in trees:
    t.backup()  # callers read node.value / n_leaves as well (the full subtree's)
    values, n_leaves = rollout_values(t, per_leaf=per_leaf)
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
def _fit_fn(pred_graphdef, tx, steps: int, members: bool = False):
  """Jitted fit: `steps` Adam steps on (x, y, w); returns (state, opt_state, first train loss,
  last train loss, held-out loss of the returned state, its step). With held-out rows (weights
  hw > 0) the returned state is the step with the lowest held-out loss (step 0 = the input).
  `members`: vmapped over a leading member axis of the state, optimizer state and weights."""
  def loss_fn(q, x, y, w):
    return predictor_bce(nnx.merge(pred_graphdef, q)(x), y, w)

  def fit(pred_state, opt_state, x, y, w, hx, hy, hw):
    has_hold = jnp.sum(hw) > 0
    h0 = jnp.where(has_hold, loss_fn(pred_state, hx, hy, hw), 0.0)

    def one(carry, i):
      s, o, best, best_loss, best_step = carry
      loss, g = jax.value_and_grad(loss_fn)(s, x, y, w)
      u, o = tx.update(g, o, s)
      s = optax.apply_updates(s, u)
      h = jnp.where(has_hold, loss_fn(s, hx, hy, hw), 0.0)
      better = has_hold & (h < best_loss)
      best = jax.tree.map(lambda a, b: jnp.where(better, a, b), s, best)
      return (s, o, best, jnp.where(better, h, best_loss),
              jnp.where(better, i + 1, best_step)), loss

    init = (pred_state, opt_state, pred_state, h0, jnp.int32(0))
    (s, o, best, best_loss, best_step), losses = jax.lax.scan(
        one, init, jnp.arange(steps, dtype=jnp.int32))
    out = jax.tree.map(lambda a, b: jnp.where(has_hold, a, b), best, s)
    step = jnp.where(has_hold, best_step, steps)
    return out, o, losses[0], losses[-1], best_loss, h0, step

  if members:
    fit = jax.vmap(fit, in_axes=(0, 0, None, None, 0, None, None, None))
  return jax.jit(fit)


@functools.lru_cache(maxsize=8)
def _member_probs_fn(pred_graphdef):
  return jax.jit(jax.vmap(lambda q, x: nnx.merge(pred_graphdef, q).prob(x), in_axes=(0, None)))


def _pad_rows(x, y, w, bucket):
  n = len(y)
  rows = max(-(-n // bucket) * bucket, bucket)  # few shapes, few compiles
  xp = np.zeros((rows, x.shape[1] if x.ndim == 2 else 0), np.float32)
  yp = np.zeros(rows, np.float32)
  wp = np.zeros(rows, np.float32)
  xp[:n], yp[:n], wp[:n] = x, y, w
  return xp, yp, wp


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
  `holdout`: share of prompts held out of the fit for early stopping (module docstring).
  `ensemble`: heads in the fit, the model's and ensemble - 1 bootstrap members (module docstring;
  1, or at least 3 so that the members have a spread); the members are created from `pred_state`
  (or at the first fit).
  """

  def __init__(self, pred_graphdef, tx, steps: int = 50, buffer_steps: int = 4,
               max_rows: int = 8192, bucket: int = 1024, seed: int = 0,
               weighting: str = "uniform", root_buffer_steps: int | None = None,
               root_features=None, leaf_weight: float = 0.0, pred_state=None,
               holdout: float = 0.0, ensemble: int = 1):
    if weighting not in ("uniform", "visits"):
      raise ValueError(f"weighting must be 'uniform' or 'visits', got {weighting!r}")
    self.graphdef, self.tx, self.steps, self.weighting = pred_graphdef, tx, steps, weighting
    self.buffer = collections.deque(maxlen=buffer_steps)
    self.roots = collections.deque(maxlen=max(root_buffer_steps or buffer_steps, buffer_steps))
    self.max_rows, self.bucket = max_rows, bucket
    self.root_features = root_features
    self.rng = np.random.default_rng(seed)
    self.leaf_weight = float(leaf_weight)
    if not 0.0 <= holdout < 1.0 or ensemble < 1:
      raise ValueError(f"need 0 <= holdout < 1 and ensemble >= 1, got {holdout}, {ensemble}")
    if ensemble == 2:  # `spread` compares bootstrap members only, and one head has no spread
      raise ValueError("ensemble=2 leaves one bootstrap member, which has no spread: use 1 (no "
                       "ensemble) or at least 3 (ensemble - 1 bootstrap members)")
    self.holdout, self.ensemble = float(holdout), int(ensemble)
    self.opt_state = None
    self.members = self.member_opt = None
    if pred_state is not None:
      self.init(pred_state)

  # ---- the fitter's own optimizer state ----------------------------------------------------------
  def init(self, pred_state) -> None:
    """Creates a fresh optimizer state for the head's parameters `pred_state`, and the ensemble's
    members: copies of `pred_state` with a small member-specific perturbation of every weight
    (N(0, 0.02^2) times the leaf's RMS), so bootstrap and start both differ between heads."""
    self.opt_state = self.tx.init(pred_state)
    if self.ensemble > 1:
      k = self.ensemble - 1
      leaves, treedef = jax.tree.flatten(pred_state)
      rng = np.random.default_rng(12345)
      stacked = []
      for x in leaves:
        x = np.asarray(x)
        if np.issubdtype(x.dtype, np.floating):
          scale = 0.02 * float(np.sqrt(np.mean(np.square(x)))) if x.size else 0.0
          noise = rng.normal(0.0, 1.0, (k, *x.shape)) * scale
          stacked.append(jnp.asarray(x[None] + noise, x.dtype))
        else:
          stacked.append(jnp.asarray(np.broadcast_to(x, (k, *x.shape))))
      self.members = jax.tree.unflatten(treedef, stacked)
      self.member_opt = jax.vmap(self.tx.init)(self.members)

  def state_dict(self) -> dict:
    """The fitter's optimizer state (and the ensemble members' parameters and optimizer states),
    a pytree of arrays (for a checkpoint). Call `init` or pass `pred_state` to the constructor
    first, so a fresh fitter has the structure to restore into."""
    if self.opt_state is None:
      raise ValueError("the fitter has no optimizer state yet: call init(pred_state) first")
    d = {"opt_state": self.opt_state}
    if self.members is not None:
      d.update(members=self.members, member_opt=self.member_opt)
    return d

  def load_state_dict(self, d: dict) -> None:
    """Restores what `state_dict` returned."""
    self.opt_state = d["opt_state"]
    if "members" in d:
      self.members, self.member_opt = d["members"], d["member_opt"]

  def spread(self, pred_state, features):
    """(mean f32[N], variance f32[N]) of p̂ over the ensemble's bootstrap members. Without members
    (`ensemble` = 1): (the head's p̂ under `pred_state`, zeros).

    Only heads fit alike are compared. The model's head `pred_state` is not one of them: the joint
    update trains it too (every RL step, nodes weighted uniformly, its own optimizer state), and
    the fitter fits it on the rows themselves rather than on a resample, so it sits apart from the
    members by a systematic gap that no amount of data closes. Counted in the variance, that gap
    would pass for the fit's sampling uncertainty and make stage 1's κ too low. The members are
    exchangeable draws of one procedure (the fit on a Poisson(1) bootstrap of the same rows), so
    their variance is the bootstrap estimate of the fit's variance, taken in its unbiased
    (n - 1) form since a run has a few members; the mean is theirs too, so (mean, variance) is one
    distribution's moment pair (`allocators.concentration_from_spread` reads κ off it; stage 1
    centres its Beta on the calibrated p̂ of the model's head)."""
    x = np.asarray(features, np.float32)
    n = len(x)
    xp = np.zeros((max(-(-n // 64) * 64, 64), x.shape[1]), np.float32)
    xp[:n] = x
    probs = _member_probs_fn(self.graphdef)
    if self.members is None:
      main = np.asarray(probs(jax.tree.map(lambda a: jnp.asarray(a)[None], pred_state), xp))
      return main[0, :n], np.zeros(n, np.float32)
    allp = np.asarray(probs(self.members, xp), np.float64)[:, :n]
    return allp.mean(0).astype(np.float32), allp.var(0, ddof=1).astype(np.float32)

  # ---- data and fit ------------------------------------------------------------------------------
  def add(self, trees) -> int:
    visits = self.weighting == "visits"
    x, y, n, root, leaf = node_examples(trees, with_meta=True, per_leaf=visits)
    if len(y):
      w = n if self.weighting == "visits" else np.ones_like(y)
      w = np.where(leaf, w * self.leaf_weight, w).astype(np.float32)
      # Each example's prompt on the held-out side or not (node_examples walks trees in order).
      held = np.concatenate([np.full(_num_examples(t, visits),
                                     held_out(t.prompt_ids, self.holdout))
                             for t in trees]).astype(bool)
      self.buffer.append((x[~root], y[~root], w[~root], leaf[~root], held[~root]))
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
    # Buffers saved before the holdout existed have 4 fields: nothing of them is held out.
    held = np.concatenate([b[4] if len(b) > 4 else np.zeros(len(b[1]), bool)
                           for b in self.buffer] +
                          [np.asarray([held_out(p, self.holdout) for p in r[3]], bool)
                           if len(r[3]) == len(r[1]) else np.zeros(len(r[1]), bool)
                           for r in roots])
    keep = w > 0  # rows without weight (leaves, by default) would only take room
    x, y, w, leaf, is_root, held = (a[keep] for a in (x, y, w, leaf, is_root, held))
    if len(y) > self.max_rows:
      keep = self.rng.choice(len(y), self.max_rows, replace=False)
      x, y, w, leaf, is_root, held = (a[keep] for a in (x, y, w, leaf, is_root, held))
    if not (~held).any():
      return done(pred_state, {})
    tr = ~held
    n = int(tr.sum())
    xp, yp, wp = _pad_rows(x[tr], y[tr], w[tr], self.bucket)
    hx, hy, hw = _pad_rows(x[held], y[held], w[held], 256)
    args = [jnp.asarray(a) for a in (xp, yp, wp, hx, hy, hw)]
    steps = int(steps or self.steps)
    fit = _fit_fn(self.graphdef, self.tx, steps)
    pred_state, self.opt_state, first, last, hbest, h0, best_step = fit(
        pred_state, self.opt_state, *args)
    # Share of the fit's weight on roots and on leaves (the rest: turn boundaries).
    wt = w[tr]
    total = float(wt.sum())
    info = dict(predictor_fit_rows=n, predictor_fit_bce_first=float(first),
                predictor_fit_bce_last=float(last),
                predictor_fit_leaf_weight_share=float(wt[leaf[tr]].sum()) / total,
                predictor_fit_root_weight_share=float(wt[is_root[tr]].sum()) / total)
    if held.any():
      info.update(predictor_fit_holdout_rows=int(held.sum()),
                  predictor_fit_holdout_bce_start=float(h0),
                  predictor_fit_holdout_bce_best=float(hbest),
                  predictor_fit_best_step=int(best_step))
    if self.members is not None:
      k = self.ensemble - 1
      boot = self.rng.poisson(1.0, (k, len(wp))).astype(np.float32) * wp[None]
      mfit = _fit_fn(self.graphdef, self.tx, steps, members=True)
      self.members, self.member_opt, *_ = mfit(self.members, self.member_opt, args[0], args[1],
                                               jnp.asarray(boot), *args[3:])
      info["predictor_fit_members"] = self.ensemble
    return done(pred_state, info)


def _num_examples(tree, per_leaf: bool = False) -> int:
  """How many rows `node_examples` makes of one tree (after its `backup`)."""
  values, _ = rollout_values(tree, per_leaf=per_leaf)
  return sum(1 for nd in tree.nodes if nd.feature is not None and values[nd.id] is not None)
