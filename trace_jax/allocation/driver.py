"""One RL step's sampling: stage 1 over prompt roots, stage 2 over turn-boundary anchors.

Host logic around the sampler engine, the same for every method: the method's strategy
(`allocation.strategies`) decides which prompts get how many rollouts, which anchors get how many
continuations and which trees are trained on; the driver issues the prompt and fork requests,
samples a random slice of the pool to measure the predictor honestly, and records every
allocation-time prediction with the outcomes that followed. All methods draw from one budget of
rollouts (`root_budget + prefix_budget`, a continuation from an anchor counts as one rollout); the
engine's ledger counts generated and prefill tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from trace_jax.allocation import allocators, predictor_metrics, strategies
from trace_jax.allocation.stage2 import Stage1View, Stage2Decisions
from trace_jax.config import RolloutSection, TrainConfig
from trace_jax.sampling.engine import PromptRequest, SamplerEngine
from trace_jax.sampling.tree import Tree


_TRAIN_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig)}


@dataclasses.dataclass(frozen=True)
class DriverConfig(RolloutSection):
  """What the driver and the strategies read: the run config's rollout section (every field, its
  default and its doc are `trace_jax.config.RolloutSection`'s, defined once there) plus the
  method and whether the random slice counts in the ledger. `from_rollout` builds one from a
  run's section; `DriverConfig(method=..., prompts_per_step=...)` one of your own."""
  method: str = _TRAIN_DEFAULTS["method"]
  count_slice: bool = False  # the random slice's cost enters the ledger (it steers the run:
  #                            Platt calibration, or the head fit on its trees)

  @classmethod
  def from_rollout(cls, method: str, rollout) -> "DriverConfig":
    """The driver's fields taken by name from a run config's rollout section
    (`trace_jax.config.RolloutSection`). `count_slice` is not a rollout field: it depends on the
    rl section too, and `driver_config` sets it."""
    kw = {f.name: getattr(rollout, f.name) for f in dataclasses.fields(RolloutSection)}
    return cls(method=method, **kw)


def driver_config(c: TrainConfig):
  """The rollout driver's settings (`DriverConfig`) of run config `c`: its method and rollout
  section, and whether the random slice counts in the ledger (when it steers: rollout.calibrate
  = platt or rl.predictor_slice)."""
  d = DriverConfig.from_rollout(c.method, c.rollout)
  # The slice steers the run when stage 1 is calibrated on it or the head is fit on its trees;
  # then its rollouts are part of the method's cost.
  steers = c.rollout.calibrate == "platt" or c.rl.predictor_slice
  return dataclasses.replace(d, count_slice=steers)


@dataclasses.dataclass
class StepSample:
  trees: list            # trees to train on
  all_trees: list        # every tree sampled (dapo: dropped groups too)
  predictions: list      # (stage, p_hat, outcome) for every rollout allocated by prediction
  info: dict
  slice_predictions: list = dataclasses.field(default_factory=list)  # ("slice", p_hat, outcome)
  slice_trees: list = dataclasses.field(default_factory=list)  # the slice's trees (released)


class RolloutDriver:
  """`sample(examples, use_predictor) -> StepSample`; examples are dicts with prompt_ids, answers,
  question... The method is `cfg.method`, a name in the strategy registry.

  `rng` (numpy Generator) and `predict` (features f32[N, D] -> p̂ f32[N]) may be replaced between
  steps (the training loop reseeds the one and sets the other from the current head).
  `predict_spread` (features -> (mean f32[N], variance f32[N]) over an ensemble of heads), when
  set, gives stage 1's Beta its concentration (`concentration`)."""

  def __init__(self, engine: SamplerEngine, cfg: DriverConfig,
               predict: Callable[[np.ndarray], np.ndarray] | None,
               prompt_features: Callable[[Sequence[Sequence[int]]], np.ndarray], seed: int = 0):
    self.strategy = strategies.get(cfg.method)(cfg)
    self.engine, self.cfg, self.predict = engine, cfg, predict
    self.prompt_features = prompt_features
    self.rng = np.random.default_rng(seed)
    self.predict_spread: Callable[[np.ndarray], tuple] | None = None
    self._slice_log: list[list] = []  # per step: the random slice's (stage, p̂, outcome)
    self._root_log: list[list] = []  # binned objective, per step: (p̂, successes, rollouts)
    self._stage2_prices: list[float] = []  # streamed stage 2: the batch price of recent steps
    # (prompt keys, RootPlan) of the next step, whose stage-1 rollouts this step started ahead
    self._ahead: tuple[list, strategies.RootPlan] | None = None

  def state_dict(self) -> dict:
    """What the driver carries from step to step (for a checkpoint): the random slice's
    (stage, raw p̂, outcome) records per step, which the Platt calibration and the running slice
    metrics read."""
    return {"slice_log": [[list(x) for x in step] for step in self._slice_log],
            "stage2_prices": list(self._stage2_prices),
            "root_log": [[list(x) for x in step] for step in self._root_log]}

  def load_state_dict(self, d: dict) -> None:
    self._slice_log[:] = [[(st, float(p), float(y)) for st, p, y in step]
                          for step in d.get("slice_log", [])]
    self._stage2_prices[:] = [float(x) for x in d.get("stage2_prices", [])]
    self._root_log[:] = [[(float(p), int(k), int(m)) for p, k, m in step]
                         for step in d.get("root_log", [])]

  def stage2_price(self, window: int = 4) -> float | None:
    """The streamed stage 2's price: the median batch price of the last `window` streamed steps
    (`Stage2Decisions.price`), None before the first."""
    recent = self._stage2_prices[-window:]
    return float(np.median(recent)) if recent else None

  def concentration(self, features) -> np.ndarray:
    """κ per prompt of stage 1's Beta(κ p̂, κ (1 - p̂)): moment-matched to the head ensemble's
    spread when `predict_spread` is set, else `root_concentration` for every prompt. f32[N]."""
    n = len(features)
    if self.predict_spread is None:
      return np.full(n, self.cfg.root_concentration, np.float32)
    mean, var = self.predict_spread(features)
    return np.asarray(allocators.concentration_from_spread(mean, var), np.float32)

  def binned_beta(self, p_hat):
    """The `binned` root objective's Beta per prompt, (mean f32[N], κ f32[N]), from the stage-1
    trees of the last `binned_window` steps (`allocators.binned_root_beta`); None before any."""
    rows = [x for step in self._root_log[-self.cfg.binned_window:] for x in step]
    if not rows:
      return None
    p, k, m = (np.asarray(v) for v in zip(*rows))
    return allocators.binned_root_beta(p, k, m, p_hat, bins=self.cfg.binned_bins)

  def _log_roots(self, views, p_hat) -> None:
    """Records each stage-1 tree's (p̂, successes, rollouts) for the binned objective."""
    if self.cfg.root_objective != "binned":
      return
    step = [(float(p), sum(float(x.reward or 0.0) > 0.5 for x in v.leaves()), len(v.leaves()))
            for v, p in zip(views, p_hat)]
    self._root_log.append([x for x in step if x[2] > 0])
    del self._root_log[:-self.cfg.binned_window]

  # ---- the strategy's decisions (also callable one by one, e.g. from a notebook) -----------------
  def root_plan(self, examples: list[dict], use_predictor: bool = True) -> strategies.RootPlan:
    """Stage 1: rollouts per prompt of the pool (`strategies.RootPlan`)."""
    return self.strategy.root_plan(self, examples, use_predictor)

  def candidates(self, trees: list[Tree]) -> list[tuple[int, int]]:
    """Stage 2's candidate anchors (tree index, node id) in finished stage-1 trees."""
    return self.strategy.candidates(trees)

  def prefix_counts(self, trees, cands, use_predictor: bool = True):
    """Stage 2: continuations per candidate i32[H], and the estimates used (f32[H] or None)."""
    return self.strategy.prefix_counts(self, trees, cands, use_predictor)

  def calibrated(self, p_hat):
    """(p̂ mapped through a Platt fit, (a, b)): the fit is on the random slice's (raw p̂, outcome)
    pairs of the last `calibrate_window` steps, unbiased since the slice is drawn without looking
    at p̂. Without calibration or slice data yet: (p̂, (1, 0))."""
    c = self.cfg
    if c.calibrate != "platt" or not self._slice_log:
      return p_hat, (1.0, 0.0)
    pairs = [x for step in self._slice_log[-c.calibrate_window:] for x in step]
    calib = allocators.platt_fit(np.asarray([x[1] for x in pairs]),
                                 np.asarray([x[2] for x in pairs]), c.calibrate_prior)
    return allocators.platt_apply(p_hat, *calib), calib

  # ---- one step ----------------------------------------------------------------------------------
  def sample(self, examples: list[dict], use_predictor: bool = True,
             ahead_examples: list[dict] | None = None,
             ahead_use_predictor: bool | None = None) -> StepSample:
    """Samples one step: stage 1 (the root plan), stage 2 (continuations from the chosen anchors;
    with `stage2="stream"` decided per tree as its stage-1 rollouts finish, in the same engine
    run), the random slice that measures p̂, value backup, the strategy's choice of trees to train
    on, and the step's record (`StepSample.info`).

    ahead_examples: the next step's prompts (rollouts one step ahead). Their root plan is made
    now, with this step's predictor, and their stage-1 rollouts start in the slots this step's
    tail leaves idle; the next call (whose `examples` must be these) adopts them and finishes them
    under the weights the engine has then. `drop_ahead()` abandons them."""
    ledger_before = dict(self.engine.ledger.as_dict())
    alloc = getattr(self.engine, "alloc", None)
    if alloc is not None:  # the peak of pages in use during this step
      alloc.peak = alloc.in_use
    adopt = self._ahead is not None
    if adopt:
      keys, plan = self._ahead
      self._ahead = None
      if keys != [tuple(e["prompt_ids"]) for e in examples]:
        self.drop_ahead()
        raise ValueError("this step's prompts are not the ones its rollouts were started ahead "
                         "for (pass the same examples, or drop_ahead() first)")
    else:
      plan = self.root_plan(examples, use_predictor)
    ahead = []
    if ahead_examples is not None:
      use = use_predictor if ahead_use_predictor is None else ahead_use_predictor
      next_plan = self.root_plan(ahead_examples, use)
      ahead = self._root_requests(ahead_examples, next_plan)
      self._ahead = ([tuple(e["prompt_ids"]) for e in ahead_examples], next_plan)
    counts = plan.counts
    predictive = plan.p_hat is not None and use_predictor
    if self.streams():
      trees, stage1, s2 = self._sample_streamed(examples, plan, use_predictor, adopt, ahead)
      slice_trees, slice_p = s2.slice_trees, s2.slice_p
    else:
      stage2_run = self.strategy.has_stage2() and self.cfg.prefix_budget > 0
      # When a second engine run follows stage 1 (stage 2, or the measured slice), the rollouts
      # ahead start there, in its idle slots: started in stage 1, they would still be live when
      # that run begins, which refuses trees carried from an earlier run.
      second_run = stage2_run or self._slices(plan.raw_p_hat, use_predictor, len(examples))
      trees = self._sample_roots(examples, plan, adopt, [] if second_run else ahead)
      stage1 = [Stage1View.of(t) for t in trees]
      s2 = Stage2Decisions()
      s2.decide(self, trees, range(len(trees)), use_predictor, self.cfg.prefix_budget)
      slice_reqs, slice_p = self._slice_requests(examples, plan.raw_p_hat, use_predictor)
      slice_trees = []
      if s2.forks or slice_reqs or (second_run and ahead):
        # The measured slice shares the stage-2 run, whose slots are mostly idle anyway; its
        # cost is taken out of this step's ledger below (unless it steers the run).
        out = self.engine.run(s2.forks + slice_reqs, **_ahead_kw(False, ahead if second_run
                                                                  else ()))
        slice_trees = out[len(out) - len(slice_reqs):] if slice_reqs else []
    predictions = []
    if predictive:
      for tree, view, p in zip(trees, stage1, plan.p_hat[counts > 0]):
        tree.root.p_hat = float(p)
        predictions += [("root", float(p), float(leaf.reward or 0.0)) for leaf in view.leaves()]
      self._log_roots(stage1, plan.p_hat[counts > 0])
    info = _stage1_info(stage1, plan, len(examples), predictive)
    cands, conts = s2.cands, np.asarray(s2.conts, np.int32)
    info.update(_stage2_info(trees, cands, conts, [not v.mixed for v in stage1]))
    if self.cfg.stage2 == "stream":
      info.update(stage2_streamed=float(self.streams()), stage2_decisions=len(s2.shares),
                  stage2_last_share=s2.shares[-1] if s2.shares else 0,
                  stage2_unspent=int(self.cfg.prefix_budget - conts.sum())
                  if self.streams() else 0)
    if s2.read_estimates and use_predictor:
      for j, (ti, nid) in enumerate(cands):
        if (ti, nid) in s2.children_before:
          tree = trees[ti]
          stage = "root_anchor" if nid == 0 else "prefix"
          for ch in set(tree.nodes[nid].children) - s2.children_before[(ti, nid)]:
            predictions += [(stage, float(s2.p_anchor[j]), float(leaf.reward or 0.0))
                            for leaf in _leaves_under(tree, ch)]
    for tree in trees:
      tree.backup()
    kept, keep_info = self.strategy.keep(trees)

    slice_preds, slice_info = self._record_slice(slice_trees, slice_p)
    if self.cfg.calibrate == "platt" and plan.p_hat is not None:
      slice_info.update(calib_a=plan.calibration[0], calib_b=plan.calibration[1])
    ledger = {k: v - ledger_before.get(k, 0) for k, v in self.engine.ledger.as_dict().items()}
    if slice_trees:
      cost = trees_cost(slice_trees)
      if not self.cfg.count_slice:  # a pure measurement: outside the method's budget
        for k, v in cost.items():
          ledger[k] -= v
      slice_info.update({f"slice_{k}": v for k, v in cost.items()},
                        slice_counted=float(self.cfg.count_slice))
      self.engine.release(slice_trees)
    # A full pool's room-making (`sampling.engine_preempt`): the sampler's, not the method's.
    sampler = {"preemptions": ledger.pop("preemptions", 0),
               "recomputed_tokens": ledger.pop("recomputed_tokens", 0)}
    if alloc is not None:
      sampler["peak_pages"] = alloc.peak
    info.update(keep_info, **slice_info, **{f"ledger_{k}": v for k, v in ledger.items()},
                **{f"sampler_{k}": v for k, v in sampler.items()})
    if adopt or ahead:
      stale = sum(t.meta.get("stale_tokens", 0) for t in trees)
      made = sum(len(n.gen_ids) for t in trees for n in t.nodes)
      info.update(stale_tokens=stale, staleness=stale / max(made, 1),
                  ahead_rollouts=self.engine.ahead_ledger.rollouts_started)
    return StepSample(trees=kept, all_trees=trees, predictions=predictions, info=info,
                      slice_predictions=slice_preds, slice_trees=slice_trees)

  def streams(self) -> bool:
    """Whether this step streams stage 2 (`stage2="stream"`): the method has a stage 2 and a
    budget for it, counted in rollouts, on an engine that takes a per-tree callback."""
    c = self.cfg
    return (c.stage2 == "stream" and self.strategy.has_stage2() and c.prefix_budget > 0
            and c.budget_unit == "rollouts" and isinstance(self.engine, SamplerEngine))

  def drop_ahead(self) -> None:
    """Abandons the rollouts started ahead for the next step (and their plan)."""
    self._ahead = None
    if isinstance(self.engine, SamplerEngine):
      self.engine.drop_carried()

  def _sample_streamed(self, examples, plan, use_predictor, adopt=False, ahead=()):
    """Stage 1, stage 2 and the slice in one engine run: each time some stage-1 trees finish,
    they receive their part of the stage-2 budget left (`Stage2Decisions.on_done`) and their
    continuations start at once, in the slots the tail of stage 1 leaves idle. The random slice
    starts with the last decision, in the tail (as in batch mode, where it shares the stage-2
    run), not competing with stage 1 for slots. The step's batch price joins the driver's record
    for the next steps."""
    reqs = self._root_requests(examples, plan)
    n = len(reqs)
    slice_reqs, slice_p = self._slice_requests(examples, plan.raw_p_hat, use_predictor)
    s2 = Stage2Decisions(self, use_predictor, n)
    s2.tail = list(slice_reqs)  # the slice joins with the last decision, in stage 2's tail
    out = self.engine.run([] if adopt else reqs, on_trees_done=s2.on_done,
                          **_ahead_kw(adopt, ahead))
    price = s2.price(self.cfg.prefix_budget)
    if price is not None:
      self._stage2_prices = (self._stage2_prices + [price])[-32:]
    trees = out[:n]
    stage1 = [s2.views[t.uid] for t in trees]
    self._mark_roots(trees, plan, stage1)
    s2.slice_trees, s2.slice_p = out[n:], slice_p
    # Decisions were made per group of trees; the record lists them by tree order, like batch.
    order = sorted(range(len(s2.cands)), key=lambda j: (s2.cands[j][0], j))
    s2.cands = [s2.cands[j] for j in order]
    s2.conts = [s2.conts[j] for j in order]
    if s2.read_estimates:
      s2.p_anchor = [s2.p_anchor[j] for j in order]
    return trees, stage1, s2

  def _root_requests(self, examples, plan) -> list[PromptRequest]:
    """Stage 1's requests; each carries its place among them (`stage1_index`: the streamed stage
    2 places trees by it)."""
    reqs = [PromptRequest(e["prompt_ids"], int(k), meta=e) for e, k in zip(examples, plan.counts)
            if k > 0]
    for i, r in enumerate(reqs):
      r.meta = dict(r.meta, stage1_index=i)
    return reqs

  def _sample_roots(self, examples, plan, adopt=False, ahead=()) -> list[Tree]:
    """Stage 1's rollouts; each tree records how many it got and whether a forced slot took it."""
    trees = self.engine.run([] if adopt else self._root_requests(examples, plan),
                            **_ahead_kw(adopt, ahead))
    self._mark_roots(trees, plan)
    return trees

  def _mark_roots(self, trees, plan, stage1=None) -> None:
    """Each tree's stage-1 rollout count (`stage1`: views taken when stage 1 ended; else its
    leaves now) and whether a forced slot took it."""
    counts = plan.counts
    for j, (tree, i) in enumerate(zip(trees, np.flatnonzero(counts > 0))):  # i: pool index
      leaves = stage1[j].leaves() if stage1 is not None else tree.leaves()
      tree.meta["stage1_rollouts"] = len(leaves)  # stage 2 may add more at the root
      for kind, idx in plan.slots.items():
        if len(idx):
          tree.meta[kind] = bool(np.isin(i, idx))

  # ---- online predictor metrics on a random slice of the pool ------------------------------------
  def _slices(self, p_root, use_predictor, n_examples: int) -> bool:
    """Whether this step measures p̂ on a random slice (`_slice_requests` gives requests)."""
    c = self.cfg
    return (p_root is not None and use_predictor and c.metric_slice > 0 and c.metric_rollouts > 0
            and n_examples > 0)

  def _slice_requests(self, examples, p_root, use_predictor):
    """A uniformly random slice of the scored pool, sampled outside the budget (not trained on):
    the allocation picks prompts near p̂ = 0.5, which hides how well p̂ ranks prompts, so its
    ranking quality is measured here, on prompts chosen without looking at p̂."""
    c = self.cfg
    if not self._slices(p_root, use_predictor, len(examples)):
      return [], []
    idx = self.rng.choice(len(examples), min(c.metric_slice, len(examples)), replace=False)
    reqs = [PromptRequest(examples[i]["prompt_ids"], int(c.metric_rollouts),
                          meta=dict(examples[i], metric_slice=True)) for i in idx]
    return reqs, [float(p_root[i]) for i in idx]

  def _record_slice(self, slice_trees, slice_p):
    """Per-rollout (p̂, outcome) of the slice, and the slice metrics so far in the run: AUC, Brier
    and calibration over all slice rollouts, the same over the last 5 steps, and p̂ stratified by
    outcome (its mean over successes and over failures)."""
    preds = [("slice", p, float(x.reward or 0.0)) for t, p in zip(slice_trees, slice_p)
             for x in t.leaves()]
    if not preds:
      return [], {}
    self._slice_log.append(preds)
    info = {}
    for name, steps in (("", self._slice_log), ("_recent", self._slice_log[-5:])):
      p = np.asarray([x[1] for s in steps for x in s])
      y = np.asarray([x[2] for s in steps for x in s])
      rep = predictor_metrics.predictor_report(p, y)
      info.update({f"slice_auc{name}": rep["auc"], f"slice_brier{name}": rep["brier"],
                   f"slice_ece{name}": rep["ece"], f"slice_n{name}": int(rep["n"])})
      if not name:
        info.update(predictor_metrics.stratified_by_outcome(p, y, prefix="slice_"))
        cc = predictor_metrics.calibration_curve(p, y, n_bins=5)
        for b in range(5):  # the run's reliability diagram so far, in the per-step metrics
          info[f"slice_calib{b}_n"] = float(cc["count"][b])
          info[f"slice_calib{b}_pred"] = float(cc["mean_pred"][b])
          info[f"slice_calib{b}_outcome"] = float(cc["mean_outcome"][b])
    return preds, info


def _stage1_info(trees, plan, pool_size: int, predictive: bool) -> dict:
  """Stage 1 in the step's record: how mixed its trees came out, how many were all failures or all
  successes, how the rollouts were spread, and (`predictive`: the plan read p̂) what it expected
  next to what it got, and the p̂ of the prompts it chose and left out."""
  counts = plan.counts
  info = dict(stage1_mixed=float(np.mean([t.mixed for t in trees])) if trees else float("nan"),
              stage1_leaves=sum(len(t.leaves()) for t in trees),
              root_counts_std=float(np.std(counts[counts > 0])) if (counts > 0).any() else 0.0,
              prompts_sampled=int((counts > 0).sum()), prompts_scored=pool_size)
  if trees:  # what the unmixed trees are: all failed, or all succeeded
    best = [max((float(x.reward or 0.0) for x in t.leaves()), default=0.0) for t in trees]
    worst = [min((float(x.reward or 0.0) for x in t.leaves()), default=0.0) for t in trees]
    info["stage1_all_fail"] = float(np.mean([b <= 0.5 for b in best]))
    info["stage1_all_success"] = float(np.mean([w > 0.5 for w in worst]))
  if predictive:
    sel, p_hat = counts > 0, plan.p_hat
    info["stage1_predicted_mixed"] = float(np.mean(allocators.root_value(p_hat[sel],
                                                                         counts[sel])))
    if plan.concentration is not None:  # what the Beta expects (no discovery term)
      mean = plan.beta_mean if plan.beta_mean is not None else p_hat
      a, b = allocators.beta_params(mean[sel], plan.concentration[sel])
      info["stage1_posterior_mixed"] = float(np.mean(allocators.root_value_posterior(
          a, b, counts[sel], int(counts.max()))))
      info["root_concentration_mean"] = float(np.mean(plan.concentration[sel]))
    if not sel.all():
      info["pool_p_hat_selected"] = float(np.mean(p_hat[sel]))
      info["pool_p_hat_left_out"] = float(np.mean(p_hat[~sel]))
      for kind, idx in plan.slots.items():
        if len(idx):
          info[f"pool_p_hat_{kind}"] = float(np.mean(p_hat[idx]))
  return info


def _stage2_info(trees, cands, conts, unmixed) -> dict:
  """Where stage 2 spends: continuations into unmixed trees (`unmixed`: per tree, as stage 1 left
  it), at roots, by anchor depth (3 = 3 and deeper), their mean anchor depth."""
  depths = [trees[ti].nodes[nid].depth for ti, nid in cands]
  info = dict(candidates=len(cands), anchors_used=int((conts > 0).sum()),
              continuations=int(conts.sum()),
              continuations_unmixed_trees=int(sum(k for (ti, _), k in zip(cands, conts)
                                                  if unmixed[ti])),
              continuations_at_roots=int(sum(k for (_, nid), k in zip(cands, conts) if nid == 0)),
              anchor_depth_mean=float(np.average(depths, weights=conts)) if conts.sum()
              else float("nan"))
  for d in range(4):
    info[f"continuations_depth{d}"] = int(sum(k for dd, k in zip(depths, conts)
                                              if min(dd, 3) == d))
  return info


def _ahead_kw(adopt: bool, ahead) -> dict:
  """`engine.run`'s keywords for rollouts one step ahead, only when used (any engine takes a
  plain call)."""
  return {**({"adopt": True} if adopt else {}), **({"ahead": list(ahead)} if ahead else {})}


def _leaves_under(tree: Tree, node_id: int):
  stack, out = [node_id], []
  while stack:
    n = tree.nodes[stack.pop()]
    if n.done:
      out.append(n)
    stack.extend(n.children)
  return out


def trees_cost(trees) -> dict[str, int]:
  """What sampling `trees` from their prompts cost, in the ledger's terms: rollouts started,
  generated tokens, prefill tokens (the prompt but its pending last token, then every
  observation prefilled: not one the pool had no pages for) and tool calls (every turn the
  environment ran on). A turn the sequence limit or the pool ended made no call and carries no
  observation; one cut by them after the environment answered (no room or no pages left for its
  observation) made one and carries it (its text, and its ids when pages ran out). Only an
  environment that answers a turn with no text at all and lets it go on, at the sequence limit,
  is not told apart."""
  turns = [n for t in trees for n in t.nodes[1:]]
  return dict(rollouts_started=sum(len(t.leaves()) for t in trees),
              generated_tokens=sum(len(n.gen_ids) for n in turns),
              prefill_tokens=sum(len(t.prompt_ids) - 1 for t in trees) +
              sum(len(n.obs_ids) for n in turns if n.truncated != "pool_exhausted"),
              tool_calls=sum(n.truncated not in ("max_seq_len", "pool_exhausted")
                             or bool(n.obs_ids or n.obs_text) for n in turns))
