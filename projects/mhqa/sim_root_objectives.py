"""What stage 1's root objectives buy and cost when the head knows how unsure it is (issue 30).

  python projects/mhqa/sim_root_objectives.py

An abstract model, not the real loop. A pool of prompts of two kinds: kinds the policy has learned
(p ~ Beta(2, 2.4), the head's logit noise small) and a kind it has not solved yet (p ~ Beta(0.4, 8),
mean 0.05, the head's logit noise large: it has seen few of them succeed). The head reports
p̂ = sigmoid(logit p + ε), ε ~ N(0, σ²), and its uncertainty as the delta-method variance
(p̂ (1 − p̂) σ)², which `allocators.concentration_from_spread` turns into a Beta concentration κ,
as the ensemble's spread does in the loop. Each step scores the pool, selects `selected` prompts
and their counts by the exact DP (`allocate_roots_subset`) under each objective's value table
(`root_value_table`: paper, posterior, discovery at several β), and the true p gives:
the expected share of mixed groups (what the paper's objective maximizes), the expected successes
on the unsolved kind (the rare outcomes that teach it), the chance of at least one such success
in the step, and the share of rollouts spent on that kind.
Writes projects/mhqa/results/root_objectives_sim.json and .png.
"""

import json
import os

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")

from absl import app, flags  # noqa: E402

_POOL = flags.DEFINE_integer("pool", 48, "candidate prompts per step")
_SELECTED = flags.DEFINE_integer("selected", 16, "prompts given rollouts per step")
_BUDGET = flags.DEFINE_integer("budget", 96, "stage-1 rollouts per step")
_UNSOLVED = flags.DEFINE_float("unsolved_share", 0.3, "share of the pool of the unsolved kind")
_SIGMA_LEARNED = flags.DEFINE_float("sigma_learned", 0.5, "head logit noise, learned kinds")
_SIGMA_UNSOLVED = flags.DEFINE_float("sigma_unsolved", 2.0, "head logit noise, unsolved kind")
_BETAS = flags.DEFINE_string("betas", "0.1,0.25,0.5,1", "discovery weights")
_STEPS = flags.DEFINE_integer("steps", 400, "simulated steps")
_OUT = flags.DEFINE_string("out", "projects/mhqa/results/root_objectives_sim", "output stem")


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp
  import numpy as np

  from trace_jax.allocation import allocators as A

  lo, hi = 2, 12
  counts = tuple(range(lo, hi + 1))
  arms = [("paper", 0.0), ("posterior", 0.0)] + [
      ("discovery", float(b)) for b in _BETAS.value.split(",")]

  @jax.jit
  def tables(p_hat, kappa):
    return {f"{o}:{b}": A.root_value_table(p_hat, counts, o, kappa, b) for o, b in arms}

  alloc = jax.jit(lambda v: A.allocate_roots_subset(jnp.zeros(v.shape[0]), _BUDGET.value,
                                                    _SELECTED.value, lo, hi, v))
  rng = np.random.default_rng(0)
  res = {f"{o}:{b}": {k: [] for k in ("mixed", "unsolved_successes", "any_unsolved_success",
                                      "unsolved_rollouts", "mean_kappa_selected")}
         for o, b in arms}
  for _ in range(_STEPS.value):
    n_uns = int(round(_POOL.value * _UNSOLVED.value))
    kind = np.zeros(_POOL.value, bool)
    kind[rng.choice(_POOL.value, n_uns, replace=False)] = True
    p = np.where(kind, rng.beta(0.4, 8.0, _POOL.value), rng.beta(2.0, 2.4, _POOL.value))
    p = np.clip(p, 1e-4, 1 - 1e-4)
    sigma = np.where(kind, _SIGMA_UNSOLVED.value, _SIGMA_LEARNED.value)
    z = np.log(p / (1 - p)) + rng.normal(0, 1, _POOL.value) * sigma
    p_hat = 1 / (1 + np.exp(-z))
    var = (p_hat * (1 - p_hat) * sigma) ** 2
    kappa = np.asarray(A.concentration_from_spread(p_hat, var))
    for key, table in tables(jnp.asarray(p_hat, jnp.float32), jnp.asarray(kappa)).items():
      m = np.asarray(alloc(table))
      sel = m > 0
      r = res[key]
      r["mixed"].append(float(np.mean(1 - p[sel] ** m[sel] - (1 - p[sel]) ** m[sel])))
      r["unsolved_successes"].append(float(np.sum((m * p)[kind])))
      r["any_unsolved_success"].append(float(1 - np.prod((1 - p[kind]) ** m[kind])))
      r["unsolved_rollouts"].append(float(m[kind].sum() / m.sum()))
      r["mean_kappa_selected"].append(float(np.mean(kappa[sel])))
  summary = {k: {m: float(np.mean(v)) for m, v in r.items()} for k, r in res.items()}
  out = dict(command="python projects/mhqa/sim_root_objectives.py",
             settings=dict(pool=_POOL.value, selected=_SELECTED.value, budget=_BUDGET.value,
                           unsolved_share=_UNSOLVED.value, sigma_learned=_SIGMA_LEARNED.value,
                           sigma_unsolved=_SIGMA_UNSOLVED.value, steps=_STEPS.value),
             arms=summary)
  os.makedirs(os.path.dirname(_OUT.value), exist_ok=True)
  with open(_OUT.value + ".json", "w") as f:
    json.dump(out, f, indent=1)
  for k, s in summary.items():
    print(f"{k:16s} mixed {s['mixed']:.3f}  unsolved successes {s['unsolved_successes']:.3f}  "
          f"P(any) {s['any_unsolved_success']:.3f}  unsolved rollouts {s['unsolved_rollouts']:.3f}")

  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  for k, s in summary.items():
    ax.scatter(s["mixed"], s["unsolved_successes"], s=40)
    ax.annotate(k.replace(":0.0", ""), (s["mixed"], s["unsolved_successes"]), fontsize=8,
                xytext=(4, 3), textcoords="offset points")
  ax.set(xlabel="expected share of mixed groups (stage 1)",
         ylabel="expected successes on the unsolved kind per step",
         title="root objectives: contrast against discovery")
  fig.tight_layout()
  fig.savefig(_OUT.value + ".png", dpi=120)


if __name__ == "__main__":
  app.run(main)
