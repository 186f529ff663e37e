"""A small model of GRPO on a lessons world, used to choose world v4 before any run on it.

Each lesson k is one Bernoulli choice (the fact verb with probability p_k, a logit), p_k = ε_k at
the warm start. A step draws 16 questions (lessons by frequency), 8 rollouts each; a rollout
succeeds when every lesson hop chose the fact verb (and, with one lesson per question, the other
hops succeed at `other`); each mixed group takes a policy-gradient step on its lessons' logits
with GRPO's normalized advantages, step size `eta`. `eta` = 2 makes v3's lessons all found
within about 10 steps, as GRPO found them on v3 (projects/lessons/README.md); the real network's
steps may be larger (lessons generalizing) or smaller. Reported per design, mean over world
draws: the warm start's mixed share of groups of 8 over the pool, held-out EM at step 50 over
step 200 (held-out balanced over lessons or drawn like training), the interquartile range of
discovery steps (p_k > 0.5) among lessons found and with those never found counted at 201, and
how many are never found.

  python projects/lessons/design_sim.py     # writes projects/lessons/results/design_sim.json
"""

import json
import os

import numpy as np

DESIGNS = {  # name: (K, eps lo, eps hi, spacing, zipf, one lesson per question)
    "v3": (24, 0.15, 0.95, "linear", 0.8, False),
    "v3, eps log [0.003, 0.9]": (24, 0.003, 0.9, "log", 0.8, False),
    "v4 without one lesson per question": (32, 0.003, 0.9, "log", 1.0, False),
    "v4": (32, 0.003, 0.9, "log", 1.0, True),
    "v4, eps log [0.01, 0.9]": (32, 0.01, 0.9, "log", 1.0, True),
    "v4, zipf 0.8": (32, 0.003, 0.9, "log", 0.8, True),
    "v4, 24 lessons": (24, 0.003, 0.9, "log", 1.0, True),
}
HOPS, HOP_P, Q, G, OTHER, STEPS = (2, 3, 4), (0.7, 0.2, 0.1), 16, 8, 0.85, 200


def world(k, lo, hi, spacing, zipf, rng):
  w = 1.0 / (rng.permutation(k) + 1.0) ** zipf
  cells = (rng.permutation(k) + 0.5) / k
  eps = (lo + (hi - lo) * cells if spacing == "linear"
         else np.exp(np.log(lo) + (np.log(hi) - np.log(lo)) * cells))
  return w / w.sum(), eps


def question(w, one, rng):
  h = rng.choice(HOPS, p=HOP_P)
  return rng.choice(len(w), size=1 if one else h, p=w)


def run(w, eps, one, eta, rng):
  a = np.log(eps / (1 - eps))
  hist = []
  for _ in range(STEPS + 1):
    p = 1 / (1 + np.exp(-a))
    hist.append(p.copy())
    grad = np.zeros(len(w))
    for _ in range(Q):
      rels = question(w, one, rng)
      chose = rng.random((G, len(rels))) < p[rels]
      r = (chose.all(1) & (rng.random(G) < (OTHER if one else 1.0))).astype(float)
      if r.std() == 0:
        continue
      adv = (r - r.mean()) / r.std()
      np.add.at(grad, rels, (adv[:, None] * np.where(chose, 1 - p[rels], -p[rels])).sum(0) / G)
    a += eta * grad
  return np.array(hist)


def mixed_share(w, eps, one, rng, n=4000):
  m = 0.0
  for _ in range(n):
    rels = question(w, one, rng)
    s = np.prod(eps[rels]) * (OTHER if one else 1.0)
    m += 1 - (1 - s) ** G - s ** G
  return m / n


def summarize(hist, w, eps):
  found = [int(np.argmax(hist[:, k] > 0.5)) if (hist[:, k] > 0.5).any() else None
           for k in range(len(w)) if eps[k] <= 0.5]
  seen = [x for x in found if x is not None]
  cens = [x if x is not None else STEPS + 1 for x in found]
  iqr = lambda v: float(np.subtract(*np.percentile(v, [75, 25]))) if v else float("nan")  # noqa
  balanced, drawn = hist.mean(1), (hist * w).sum(1)
  return dict(em50_over_final_balanced=balanced[50] / balanced[-1],
              em50_over_final_drawn=drawn[50] / drawn[-1], iqr_found=iqr(seen),
              iqr_censored=iqr(cens), never_found=len(found) - len(seen))


def main():
  out = {}
  for eta in (2.0, 4.0):
    for name, (k, lo, hi, spacing, zipf, one) in DESIGNS.items():
      rows = []
      for seed in range(5):
        rng = np.random.default_rng(seed)
        w, eps = world(k, lo, hi, spacing, zipf, rng)
        rows.append(dict(summarize(run(w, eps, one, eta, rng), w, eps),
                         mixed_share=mixed_share(w, eps, one, rng)))
      row = out[f"{name} | eta {eta:g}"] = {key: float(np.mean([r[key] for r in rows]))
                                             for key in rows[0]}
      print(f"{name:38s} eta {eta:g}: " + ", ".join(f"{key} {v:.2f}" for key, v in row.items()),
            flush=True)
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "design_sim.json")
  with open(path, "w") as f:
    json.dump(dict(command="python projects/lessons/design_sim.py", designs=DESIGNS, runs=out),
              f, indent=1)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
