"""How much of the batch stage-2 objective the streamed decision keeps (issue 29, item 1).

  python benchmarks/stream_allocation.py --steps=8

On the default config's warm start (after its probe fit of the head), for each of `--steps` RL
steps' prompts: stage 1 is sampled with a callback that records the groups in which the trees go
idle (what a streamed run's callback would see before its first fork), then stage 2 is decided
twice on the same recorded trees: by the batch allocator over every tree with the whole budget,
and group by group in the recorded order as `rollout.stage2=stream` decides it (each group its
share of the budget left). Both count vectors are scored by the method's own objective with the
batch decision's anchor estimates: `trace_tree` by the tree-aware objective, `trace` by
sum_h (1 - q_h^k_h). Reported per step and as a median: the streamed value over the batch value,
the continuations each spent, and the number of groups; the median also over the priced steps
only (the first step has no price yet and takes fair shares). `--max_share=1,2,3` compares the
cap on a priced group's take (in fair shares), `--deadlines=0,0.25` the share of trees still
running at which the budget left is spent (`rollout.stage2_deadline`). No timing: the machine
may be busy. Writes results/stream_allocation.json (and .png: the ratio per step and method).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

_CONFIG = flags.DEFINE_string("config", "tiny", "variant of configs/mhqa.py")
_STEPS = flags.DEFINE_integer("steps", 8, "RL steps' prompt batches to score")
_METHODS = flags.DEFINE_string("methods", "trace_tree,trace", "methods with a predicted stage 2")
_OUT = flags.DEFINE_string("out", "results/stream_allocation", "output stem")
_MAX_SHARE = flags.DEFINE_string("max_share", "", "comma-separated `Stage2Decisions.max_share` "
                                 "values to compare (default: the driver's)")
_DEADLINES = flags.DEFINE_string("deadlines", "0", "comma-separated `rollout.stage2_deadline` "
                                 "values to compare (0: the last group spends what is left)")


def objective(method, cfg, trees, cands, counts, p_anchor, outcomes) -> float:
  """The method's stage-2 objective of `counts` over the candidates."""
  from trace_jax.allocation import allocators

  valid = np.ones(len(cands), bool)
  if method == "trace":
    return float(allocators.prefix_objective(p_anchor, outcomes, counts, valid))
  tree = np.asarray([ti for ti, _ in cands], np.int32)
  mixed = np.asarray([t.mixed for t in trees], bool)
  return float(allocators.tree_aware_objective(p_anchor, outcomes, counts, tree, mixed, valid,
                                               cfg.tree_lambda))


def main(argv):
  del argv
  from configs import mhqa
  from trace_jax import train
  from trace_jax.allocation.driver import RolloutDriver
  from trace_jax.allocation.stage2 import Stage2Decisions
  from trace_jax.allocation.strategies.predicted import anchor_estimates

  c = mhqa.validate(mhqa.get_config(_CONFIG.value)).replace(workdir="/tmp/stream_allocation")
  run = train.build(c)
  state = train.probe_warm_start(run, train.init_state(run))
  predict = lambda f: run.predict(train.host_tree(state.train["pred_params"]), f)
  rows = []
  shares = [float(x) for x in _MAX_SHARE.value.split(",")] if _MAX_SHARE.value else [
      Stage2Decisions.max_share]
  deadlines = [float(x) for x in _DEADLINES.value.split(",")]
  variants = [(s, d) for s in shares for d in deadlines]
  for method in _METHODS.value.split(","):
    dcfg = dataclasses.replace(run.driver.cfg, method=method, metric_slice=0)
    driver = RolloutDriver(run.engine, dcfg, predict, run.engine.prompt_features, seed=c.seed)
    for step in range(_STEPS.value):
      driver.rng = np.random.default_rng([c.seed, step, 1])
      examples = train.step_examples(run, step)
      plan = driver.root_plan(examples)
      reqs = driver._root_requests(examples, plan)
      for i, r in enumerate(reqs):
        r.meta = dict(r.meta, stage1_index=i)
      groups = []
      trees = run.engine.run(reqs, on_trees_done=lambda ts: groups.append(list(ts)) or [])
      try:
        cands = driver.candidates(trees)
        batch, _ = driver.prefix_counts(trees, cands)
        p_anchor, outcomes = anchor_estimates(driver, trees, cands, True)
        vb = objective(method, dcfg, trees, cands, batch, p_anchor, outcomes)
        used = driver.stage2_price()
        for share, deadline in variants:
          driver.cfg = dataclasses.replace(dcfg, stage2_deadline=deadline)
          stream = Stage2Decisions(driver, True, len(trees))
          stream.max_share = share
          for g in groups:
            stream.on_done(g)
          got = dict(zip(stream.cands, stream.conts))
          streamed = np.asarray([got.get(tuple(cd), 0) for cd in cands], np.int32)
          vs = objective(method, dcfg, trees, cands, streamed, p_anchor, outcomes)
          driver.cfg = dcfg
          rows.append(dict(method=method, max_share=share, deadline=deadline, step=step,
                           trees=len(trees),
                           groups=len(groups), candidates=len(cands), batch_value=vb,
                           stream_value=vs, ratio=vs / vb if vb > 0 else 1.0,
                           batch_continuations=int(batch.sum()),
                           stream_continuations=int(streamed.sum()), price_used=used))
          print(json.dumps(rows[-1]), flush=True)
        price = stream.price(dcfg.prefix_budget)  # as a streamed step records it for the next
        if price is not None:  # (the price depends on the curves, recorded for every group
          # whatever max_share or the deadline)
          driver._stage2_prices.append(price)
      finally:
        run.engine.release(trees)
  summary = {}
  for method, (share, deadline) in [(m, v) for m in _METHODS.value.split(",")
                                     for v in variants]:
    rs = [r for r in rows if r["method"] == method and r["max_share"] == share
          and r["deadline"] == deadline]
    key = f"{method}, max_share {share:g}" + (f", deadline {deadline:g}" if deadline else "")
    summary[key] = dict(
        median_ratio=float(np.median([r["ratio"] for r in rs])),
        median_ratio_priced=float(np.median([r["ratio"] for r in rs if r["price_used"] is not None]
                                            or [np.nan])),
        min_ratio=float(np.min([r["ratio"] for r in rs])),
        median_groups=float(np.median([r["groups"] for r in rs])),
        unspent=int(sum(r["batch_continuations"] - r["stream_continuations"] for r in rs)))
  out = dict(command="python benchmarks/stream_allocation.py " + " ".join(sys.argv[1:]),
             config=_CONFIG.value, prefix_budget=c.rollout.prefix_budget, rows=rows,
             summary=summary)
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  with open(_OUT.value + ".json", "w") as f:
    json.dump(out, f, indent=1)
  print(json.dumps(summary, indent=1))

  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 3.5))
  for key in summary:
    method = key.split(", ")[0]
    rs = [r for r in rows if r["method"] == method and key == f"{method}, max_share "
          f"{r['max_share']:g}" + (f", deadline {r['deadline']:g}" if r["deadline"] else "")]
    ax.plot([r["step"] for r in rs], [r["ratio"] for r in rs], marker="o", label=key)
  ax.axhline(0.95, color="grey", ls="--", lw=0.8)
  ax.set(xlabel="RL step's prompts", ylabel="streamed / batch objective",
         title="stage 2 streamed vs batch, same recorded trees")
  ax.legend()
  fig.tight_layout()
  fig.savefig(_OUT.value + ".png", dpi=110)


if __name__ == "__main__":
  app.run(main)
