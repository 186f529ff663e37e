"""How good must the predictor be for pool selection to halve GRPO's wasted groups?

  python projects/mhqa/sim_pool_selection.py --grpo_er=0.717

An abstract model, not the real loop: prompt success probabilities p ~ Beta(a, b), with the mean
and spread fitted so that 8 uniform rollouts per prompt give the measured GRPO effective ratio;
the predictor sees logit(p) plus Gaussian noise of scale sigma. Each step scores a pool of
candidates, keeps `selected` of them by the exact DP of `allocate_roots_subset`, and gives them
`root_budget` rollouts; the expected share of mixed groups is the model's stage-1 effective
ratio. Writes projects/mhqa/results/pool_selection_sim.json and .png.
"""

import json
import os
import sys

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")

from absl import app, flags  # noqa: E402

_GRPO_ER = flags.DEFINE_float("grpo_er", 0.717, "measured GRPO effective ratio (8 per prompt)")
_MEAN = flags.DEFINE_float("mean_success", 0.45, "mean sampled success of the policy")
_POOLS = flags.DEFINE_string("pools", "16,32,48,96", "candidate pool sizes")
_SIGMAS = flags.DEFINE_string("sigmas", "0,0.5,1,1.5,2,3", "predictor logit noise scales")
_STEPS = flags.DEFINE_integer("steps", 300, "simulated steps per point")
_OUT = flags.DEFINE_string("out", "projects/mhqa/results/pool_selection_sim",
                            "output stem")


def main(argv):
  del argv
  import functools

  import jax
  import numpy as np

  from trace_jax.allocation.allocators import allocate_roots_subset, root_value

  def v_root(p, m):
    return np.asarray(root_value(p, m), np.float64)

  rng = np.random.default_rng(0)
  mean = _MEAN.value

  def grpo_er(conc):  # expected share of mixed groups of 8 under Beta(mean * conc, ...)
    p = np.random.default_rng(1).beta(mean * conc, (1 - mean) * conc, 200_000)
    return float(np.mean(v_root(p, 8)))

  lo, hi = 0.05, 50.0  # the share of mixed groups grows with the concentration: bisect
  for _ in range(40):
    mid = (lo * hi) ** 0.5
    lo, hi = (mid, hi) if grpo_er(mid) < _GRPO_ER.value else (lo, mid)
  conc = (lo * hi) ** 0.5
  a, b = mean * conc, (1 - mean) * conc
  selected, budget = 16, 96
  f = jax.jit(functools.partial(allocate_roots_subset, budget=budget, num_selected=selected,
                                min_per_prompt=2, max_per_prompt=12))
  rows = []
  for pool in map(int, _POOLS.value.split(",")):
    for sigma in map(float, _SIGMAS.value.split(",")):
      ers = []
      for _ in range(_STEPS.value):
        p = np.clip(rng.beta(a, b, pool), 1e-4, 1 - 1e-4)
        logit = np.log(p / (1 - p)) + sigma * rng.standard_normal(pool)
        p_hat = (1 / (1 + np.exp(-logit))).astype(np.float32)
        m = np.asarray(f(p_hat))
        ers.append(float(np.sum(v_root(p, m)) / selected))
      rows.append(dict(pool=pool, sigma=sigma, stage1_er=float(np.mean(ers))))
      print(rows[-1], flush=True)
  out = dict(command="python projects/mhqa/sim_pool_selection.py " + " ".join(sys.argv[1:]),
             beta=dict(a=a, b=b), grpo_er_target=_GRPO_ER.value,
             halving_threshold=1 - 0.5 * (1 - _GRPO_ER.value), selected=selected,
             root_budget=budget, rows=rows)
  os.makedirs(os.path.dirname(_OUT.value), exist_ok=True)
  with open(_OUT.value + ".json", "w") as fh:
    json.dump(out, fh, indent=1)
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4))
  for pool in sorted({r["pool"] for r in rows}):
    rr = [r for r in rows if r["pool"] == pool]
    ax.plot([r["sigma"] for r in rr], [r["stage1_er"] for r in rr], "o-", label=f"pool {pool}")
  ax.axhline(_GRPO_ER.value, color="gray", ls=":", label="GRPO (8 per prompt)")
  ax.axhline(out["halving_threshold"], color="k", ls="--", label="halves GRPO's waste")
  ax.set(xlabel="predictor logit noise sigma", ylabel="expected stage-1 effective ratio",
         title=f"16 of N prompts, {budget} rollouts")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(_OUT.value + ".png", dpi=100)


if __name__ == "__main__":
  app.run(main)
