"""Statistics over seeds for the comparison scripts (numpy and scipy: no jax is imported).

`is_finite` is the filter every figure here applies; `mean` is the mean of the finite values
(`mean_of`: of one key over records); `stats` gives mean, sample std, range and count of a set of
per-seed values; `welch` compares two such sets (difference of means, its standard error, t, the
Welch-Satterthwaite degrees of freedom and the two-sided p); `spearman` and `spearman_test`
rank-correlate two sets; `wasted_ratio` compares two effective ratios' wasted groups; `fmt`
and `fmt_welch` write them as table cells.
"""

from __future__ import annotations

import numbers

import numpy as np


def is_finite(v) -> bool:
  """Whether v is a finite real number (numpy scalars count; None, NaN, inf and bools do not)."""
  return (isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))
          and bool(np.isfinite(v)))


def _finite(vals) -> list[float]:
  """The finite real numbers in vals (the `is_finite` filter)."""
  return [float(v) for v in vals if is_finite(v)]


def mean(vals) -> float | None:
  """The mean of the finite numbers in vals (the `stats` filter); None when there are none."""
  vals = _finite(vals)
  return float(np.mean(vals)) if vals else None


def mean_of(records, key) -> float | None:
  """`mean` of one key over a list of records (dicts); records without the key are left out."""
  return mean([r.get(key) for r in records])


def stats(vals) -> dict | None:
  """mean, std (sample, ddof 1; 0 for one value), min, max and n of the finite numbers in vals;
  None when there are none."""
  vals = _finite(vals)
  if not vals:
    return None
  return dict(mean=float(np.mean(vals)), std=float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0,
              min=float(np.min(vals)), max=float(np.max(vals)), n=len(vals))


def welch(a, b) -> dict | None:
  """Welch's comparison of two sets of per-seed values: the difference of means (a - b), its
  standard error from the two sample variances, t = diff / se, the Welch-Satterthwaite degrees
  of freedom and the two-sided p of t at those degrees; None with fewer than two finite values on
  a side or no spread on either."""
  from scipy import stats as st  # a dependency of jax
  a, b = np.asarray(_finite(a), np.float64), np.asarray(_finite(b), np.float64)
  if len(a) < 2 or len(b) < 2:
    return None
  va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
  se = float(np.sqrt(va + vb))
  if se < 1e-12:  # equal values up to rounding on both sides
    return None
  df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
  diff = float(a.mean() - b.mean())
  t = diff / se
  return dict(diff=diff, se=se, t=t, df=float(df), p=float(2 * st.t.sf(abs(t), df)),
              n=[len(a), len(b)])


def wasted_ratio(er, ref_er) -> float | None:
  """Wasted groups as a share of a reference's: (1 − ER) / (1 − ER_ref), from two mean effective
  ratios (the issue's low-contrast target is at most 0.5); None without both, or when the
  reference wastes nothing."""
  if er is None or ref_er is None or ref_er >= 1.0:
    return None
  return (1.0 - er) / (1.0 - ref_er)


def _ranks(v):
  order = np.argsort(v, kind="stable")
  r = np.empty(len(v))
  r[order] = np.arange(len(v), dtype=np.float64)
  for u in np.unique(v):  # ties share their mean rank
    r[v == u] = r[v == u].mean()
  return r


def spearman(x, y) -> float | None:
  """Rank correlation (average ranks for ties); None below 3 pairs or with a constant side."""
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  if len(x) != len(y):
    raise ValueError(f"spearman: {len(x)} against {len(y)} values")
  if len(x) < 3:
    return None
  rx, ry = _ranks(x), _ranks(y)
  if rx.std() == 0 or ry.std() == 0:
    return None
  return float(np.corrcoef(rx, ry)[0, 1])


EXACT_SPEARMAN_N = 8  # up to this many pairs the p is exact (every permutation, 8! = 40,320)


def spearman_test(x, y, fitted: int = 0) -> dict | None:
  """`spearman` with its two-sided p: {rho, p, n, df}. Up to `EXACT_SPEARMAN_N` pairs the p is
  exact (the share of all orderings of y whose |rho| reaches the observed one; df None); beyond,
  it is the usual t = rho sqrt(df / (1 - rho^2)) at df = n - 2 - `fitted` degrees of freedom,
  where `fitted` counts means already taken out of the values (one per group when they are
  residuals from group means). With ties the t form is approximate."""
  import itertools

  from scipy import stats as st
  rho = spearman(x, y)
  if rho is None:
    return None
  n = len(x)
  if n <= EXACT_SPEARMAN_N:
    rx, ry = _ranks(np.asarray(x, np.float64)), _ranks(np.asarray(y, np.float64))
    rx = rx - rx.mean()
    obs = abs(float(rx @ (ry - ry.mean())))
    hits = total = 0
    for perm in itertools.permutations(ry):
      total += 1
      hits += abs(float(rx @ (np.asarray(perm) - ry.mean()))) >= obs - 1e-9
    return dict(rho=rho, p=hits / total, n=n, df=None)
  df = n - 2 - fitted
  if df < 1:
    return None
  if abs(rho) >= 1.0:
    return dict(rho=rho, p=0.0, n=n, df=df)
  t = rho * np.sqrt(df / (1.0 - rho * rho))
  return dict(rho=rho, p=float(2 * st.t.sf(abs(t), df)), n=n, df=df)


def fmt(s, digits: int = 3) -> str:
  """A `stats` dict as `mean ± std` (the mean alone for one value), a float with its sign, or
  `-`."""
  if s is None:
    return "-"
  if isinstance(s, dict):
    if s["n"] > 1:
      return f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f}"
    return f"{s['mean']:.{digits}f}"
  return f"{s:+.{digits}f}" if isinstance(s, float) else str(s)


def fmt_welch(w, digits: int = 3) -> str:
  """`+0.025 (t 3.3, df 12.6, p 0.006)`: a `welch` difference, its t, degrees of freedom and
  two-sided p, or `-`. With few seeds df is small and a given t means less: t 3 is p 0.011 at
  df 12, 0.058 at df 3."""
  if not w:
    return "-"
  return (f"{w['diff']:+.{digits}f} (t {w['t']:.1f}, df {w['df']:.1f}, "
          f"p {w['p']:.2g})")
