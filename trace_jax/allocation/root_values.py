"""Stage 1's values: what m rollouts of a prompt are worth, under the tables the root allocators
(`root_allocators`) maximize.

The paper's V_root(p, m) = 1 - p^m - (1 - p)^m is the chance that m independent rollouts of a
prompt with success probability p are mixed. The other objectives (`ROOT_OBJECTIVES`) read p as a
Beta the head is unsure about: its expected V_root (`root_value_posterior`), plus what the
rollouts teach about p (`information_gain`), or a Beta taken from past outcomes at similar p̂
(`binned_root_beta`). `root_value_table` lays any of them out for the allocators.
"""

from __future__ import annotations

import jax
import numpy as np
import jax.numpy as jnp


def root_value(p, m):
  """Probability that `m` rollouts with success probability `p` hold both outcomes.

  Args:
    p: f32[...] success probabilities (clipped to [0, 1]).
    m: i32[...] rollout counts, broadcastable with p.

  Returns:
    f32[...]: 1 - p^m - (1 - p)^m, and 0 for m = 0 (the formula would give -1 there).

  Example:
    >>> print(np.asarray(root_value(jnp.array([0.5, 0.5, 0.9]), jnp.array([1, 2, 2]))).round(3))
    [0.   0.5  0.18]
  """
  p = jnp.clip(jnp.asarray(p, jnp.float32), 0.0, 1.0)
  m = jnp.asarray(m)
  mf = m.astype(jnp.float32)
  return jnp.where(m >= 1, 1.0 - p**mf - (1.0 - p) ** mf, 0.0)


ROOT_OBJECTIVES = ("paper", "posterior", "discovery", "binned")


def binned_root_beta(p_log, k_log, m_log, p_query, bins: int = 8, prior: float = 2.0,
                     kappa_range: tuple[float, float] = (0.05, 1e4)):
  """Stage 1's Beta over each query prompt's success rate, read off the outcomes of past prompts
  with similar p̂ instead of taken from p̂ itself.

  A head's p̂ is an average over the prompts that look alike to it; where those mostly always or
  never succeed, a p̂ of 0.5 belongs to prompts that will rarely mix, and V_root(p̂, m) (which
  reads p̂ as the prompt's own rate) sends the budget to exactly them. Here the logged prompts
  (p̂ they were allocated with, k successes of their m stage-1 rollouts) are cut into `bins`
  quantile bins of p̂; each bin gets a Beta by moments: mean μ = (Σk + prior μ_all) / (Σm +
  prior) and the spread of the true rates Var = μ(1 - μ) - E[p(1 - p)], with E[p(1 - p)]
  estimated without bias as the mean of k(m - k) / (m(m - 1)) over prompts with m >= 2; κ =
  μ(1 - μ) / Var - 1, clipped to `kappa_range` (the top when the rates do not spread beyond
  sampling noise). Each query prompt takes its bin's (μ, κ). Since stage 1 selects on p̂ alone,
  the outcomes given p̂ are not biased by the selection.

  Args:
    p_log, k_log, m_log: f[N] logged p̂, successes and stage-1 rollouts (m >= 1).
    p_query: f[Q] p̂ of the prompts to value.
    bins: quantile bins (at most N // 4 are used, at least 1).
    prior: pseudo-rollouts pulling a bin's mean toward the log's.
    kappa_range: (lo, hi) bounds of κ.

  Returns:
    (mu f32[Q], kappa f32[Q]), for `root_value_table(mu, counts, "binned", kappa)`.

  Example:
    >>> p_log = np.r_[np.full(8, 0.5), np.full(8, 0.9)]  # p̂ 0.5: always or never; p̂ 0.9: coins
    >>> k_log, m_log = np.r_[[0, 6] * 4, [3] * 8], np.full(16, 6)
    >>> mu, kappa = binned_root_beta(p_log, k_log, m_log, np.array([0.5, 0.9]), bins=2)
    >>> mu.round(2).tolist(), (kappa < 0.1).tolist()  # a U-shaped Beta at 0.5, a tight one at 0.9
    ([0.5, 0.5], [True, False])
  """
  p_log, p_query = np.asarray(p_log, np.float64), np.asarray(p_query, np.float64)
  k_log, m_log = np.asarray(k_log, np.float64), np.asarray(m_log, np.float64)
  if not (p_log.shape == k_log.shape == m_log.shape) or p_log.ndim != 1:
    raise ValueError(f"p_log, k_log, m_log must be f[N] alike, got {p_log.shape}, "
                     f"{k_log.shape}, {m_log.shape}")
  if len(p_log) == 0:
    raise ValueError("binned_root_beta needs at least one logged prompt")
  if np.any(m_log < 1) or np.any(k_log < 0) or np.any(k_log > m_log):
    raise ValueError("need 0 <= k <= m and m >= 1 for every logged prompt")
  lo, hi = kappa_range
  n_bins = max(1, min(int(bins), len(p_log) // 4))
  edges = np.quantile(p_log, np.linspace(0.0, 1.0, n_bins + 1)[1:-1])
  at_log, at_query = np.searchsorted(edges, p_log), np.searchsorted(edges, p_query)
  mu_all = k_log.sum() / m_log.sum()
  mu_b, kappa_b = np.empty(n_bins), np.empty(n_bins)
  for b in range(n_bins):
    sel = at_log == b
    k, m = k_log[sel], m_log[sel]
    mu = (k.sum() + prior * mu_all) / (m.sum() + prior)
    mu = float(np.clip(mu, 1e-3, 1.0 - 1e-3))
    two = m >= 2
    if two.any():
      pq = float(np.mean(k[two] * (m[two] - k[two]) / (m[two] * (m[two] - 1.0))))
      var = mu * (1.0 - mu) - pq
      kappa = mu * (1.0 - mu) / var - 1.0 if var > 0 else hi
    else:
      kappa = hi
    mu_b[b], kappa_b[b] = mu, float(np.clip(kappa, lo, hi))
  return mu_b[at_query].astype(np.float32), kappa_b[at_query].astype(np.float32)


def _log_rising(x, n, max_n: int):
  """log of the rising factorial x (x + 1) ... (x + n - 1) for integer 0 <= n <= max_n (static):
  a sum of logs, exact where log-gamma differences of large x lose every digit in f32."""
  i = jnp.arange(max_n, dtype=jnp.float32)
  x, n = jnp.asarray(x, jnp.float32)[..., None], jnp.asarray(n, jnp.float32)[..., None]
  return jnp.sum(jnp.where(i < n, jnp.log(x + i), 0.0), axis=-1)


def _log_beta_moment(a, b, k, j, max_n: int):
  """log E[p^k (1 - p)^j] for p ~ Beta(a, b) and integers k + j <= max_n (static), i.e.
  log B(a + k, b + j) - log B(a, b) = log (a)_k + log (b)_j - log (a + b)_(k + j)."""
  return (_log_rising(a, k, max_n) + _log_rising(b, j, max_n)
          - _log_rising(a + b, jnp.asarray(k) + jnp.asarray(j), max_n))


def beta_params(p, concentration):
  """(a, b) of the Beta with mean p and concentration κ = a + b. Two f32 arrays, broadcast."""
  p = jnp.clip(jnp.asarray(p, jnp.float32), 1e-6, 1 - 1e-6)
  k = jnp.asarray(concentration, jnp.float32)
  return k * p, k * (1.0 - p)


def concentration_from_spread(mean, var, lo: float = 2.0, hi: float = 1e4):
  """κ of the Beta whose mean and variance match (mean, var): κ = mean (1 - mean) / var - 1,
  clipped to [lo, hi] (a spread wider than a Beta can have gives lo; no spread gives hi)."""
  mean = jnp.clip(jnp.asarray(mean, jnp.float32), 1e-6, 1 - 1e-6)
  var = jnp.maximum(jnp.asarray(var, jnp.float32), 1e-12)
  return jnp.clip(mean * (1.0 - mean) / var - 1.0, lo, hi)


def root_value_posterior(a, b, m, max_m: int):
  """E[V_root(p, m)] for p ~ Beta(a, b): the chance m rollouts are mixed, averaged over what the
  head does not know about p.

    E[1 - p^m - (1 - p)^m] = 1 - B(a + m, b) / B(a, b) - B(a, b + m) / B(a, b),

  computed as sums of logs (m <= max_m, static). As a + b -> infinity with a / (a + b) = p̂ it
  tends to the paper's V_root(p̂, m). At finite concentration it is never larger (p^m and
  (1 - p)^m are convex, so Jensen's inequality lowers it): the uncertain head expects fewer mixed
  groups than its point estimate promises, most of all where the Beta puts mass near 0 or 1.
  0 for m = 0. f32, broadcast over (a, b, m).

  Example:
    >>> a, b = beta_params(0.9, jnp.array([4.0, 1e6]))
    >>> print(np.asarray(root_value_posterior(a, b, 4, max_m=4)).round(3))  # V_root(0.9, 4): 0.344
    [0.266 0.344]
  """
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  mf = jnp.asarray(m).astype(jnp.float32)
  v = (1.0 - jnp.exp(_log_beta_moment(a, b, mf, 0.0, max_m))
       - jnp.exp(_log_beta_moment(a, b, 0.0, mf, max_m)))
  return jnp.where(mf >= 1, v, 0.0)


def information_gain(a, b, m, max_m: int):
  """Expected information (nats) that m rollouts' outcomes k give about p ~ Beta(a, b): the
  mutual information I(p; k) = H(k) - E_p[H(k | p)], k ~ BetaBinomial(m, a, b). In closed form,
  with w_k = B(a + k, b + m - k) / B(a, b) and P(k) = C(m, k) w_k:

    I = sum_k P(k) [-log w_k + k ψ(a + k) + (m - k) ψ(b + m - k) - m ψ(a + b + m)],

  (E_p[p^k (1-p)^(m-k) log p] = w_k (ψ(a + k) - ψ(a + b + m)) gives the conditional entropy). It
  is 0 for m = 0, grows with m with shrinking increments (conditionally independent draws), and
  tends to 0 as the Beta concentrates (nothing left to learn). `max_m` (static) bounds m.

  Example:
    >>> a, b = beta_params(0.5, jnp.array([2.0, 1e6]))
    >>> print(np.asarray(information_gain(a, b, 4, max_m=4)).round(3))
    [0.522 0.   ]
  """
  a, b = jnp.asarray(a, jnp.float32)[..., None], jnp.asarray(b, jnp.float32)[..., None]
  mf = jnp.asarray(m).astype(jnp.float32)[..., None]
  k = jnp.arange(max_m + 1, dtype=jnp.float32)
  on = k <= mf
  j = jnp.where(on, mf - k, 0.0)
  kk = jnp.where(on, k, 0.0)
  log_w = _log_beta_moment(a, b, kk, j, max_m)
  lg = jax.scipy.special.gammaln
  log_c = lg(mf + 1.0) - lg(kk + 1.0) - lg(j + 1.0)
  prob = jnp.where(on, jnp.exp(log_c + log_w), 0.0)
  dg = jax.scipy.special.digamma
  top = dg(a + b + mf)
  term = -log_w + kk * (dg(a + kk) - top) + j * (dg(b + j) - top)
  return jnp.maximum(jnp.sum(jnp.where(on, prob * term, 0.0), axis=-1), 0.0)


def root_value_table(p_hat, counts, objective: str = "paper", concentration=8.0,
                     beta: float = 0.5):
  """Stage 1's value of giving each prompt each count: f32[P, K] for the static `counts` (K).

    paper:     V_root(p̂, m) = 1 - p̂^m - (1 - p̂)^m.
    posterior: E[V_root(p, m)] under p ~ Beta(κ p̂, κ (1 - p̂)) (`root_value_posterior`).
    discovery: posterior + β I(p; k_m) (`information_gain`): rollouts are also worth what they
               teach about a prompt whose p is unknown, which is how a prompt kind the policy has
               not solved yet (p̂ low but uncertain) gets rollouts that can find its first success.
    binned:    the posterior's table, with p_hat and κ the Beta that past outcomes give each
               prompt's bin of p̂ (`binned_root_beta`) rather than the head's.

  κ (`concentration`, scalar or f32[P]) is the head's certainty in pseudo-rollouts; both
  objectives reduce to "paper" as κ -> infinity. Any table of this shape can go to the allocators
  (`allocate_roots(values=...)`, `allocate_roots_subset(values=...)`).
  """
  if objective not in ROOT_OBJECTIVES:
    raise ValueError(f"unknown root objective {objective!r}; choose one of {ROOT_OBJECTIVES}")
  p = jnp.clip(jnp.asarray(p_hat, jnp.float32), 0.0, 1.0)[:, None]
  m = jnp.asarray(counts, jnp.int32)[None, :]
  if objective == "paper":
    return root_value(p, m)
  kappa = jnp.broadcast_to(jnp.asarray(concentration, jnp.float32), p.shape[:1])[:, None]
  a, b = beta_params(p, kappa)
  max_m = int(max(np.max(np.asarray(counts)), 0))
  v = root_value_posterior(a, b, m, max_m)
  if objective == "discovery":
    v = v + beta * information_gain(a, b, m, max_m)
  return v
