"""Where to spend the sampling budget: TRACE stage 1 (roots) and stage 2 (prefixes).

All allocators are pure, jittable functions of arrays. Each returns integer counts of new
rollouts (stage 1: per prompt) or continuations (stage 2: per candidate anchor).

Stage 1 maximizes sum_i V_root(p_i, m_i) with V_root(p, m) = 1 - p^m - (1 - p)^m, the chance that m
independent rollouts of a prompt with success probability p are mixed. Stage 2 values k
continuations from an anchor h, whose rollout ended with outcome r, by V_pref(h, k) = 1 - q_h^k,
where q_h = r p_h + (1 - r)(1 - p_h) is the chance that one continuation repeats r.

The greedy loops run one pick per iteration, O(num_candidates) work each; budgets are hundreds to a
few thousand picks, which is cheap next to sampling a single token.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import jax.numpy as jnp

# Keeps log(q) finite where q == 0 (a continuation surely differs from r); exp(k * log) -> 0 anyway.
_TINY = 1e-30


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


def _root_gain(p, m):
  """V_root(p, m + 1) - V_root(p, m), computed directly to avoid cancellation. f32[P]."""
  mf = m.astype(jnp.float32)
  gain = p**mf * (1.0 - p) + (1.0 - p) ** mf * p
  # One rollout is never mixed, so the first one earns nothing on its own.
  return jnp.where(m >= 1, gain, 0.0)


def allocate_roots(p_hat, budget: int, min_per_prompt: int = 1, max_per_prompt: int | None = None,
                   values=None):
  """Stage 1: rollouts per prompt maximizing sum_i V_root(p_hat_i, m_i).

  Constraints: sum_i m_i = budget and min_per_prompt <= m_i <= max_per_prompt. For m >= 1 the
  marginal gain p^m (1 - p) + (1 - p)^m p is non-increasing in m (V_root is concave there), so
  handing out units one at a time to the largest marginal gain is exact for this separable concave
  problem with box constraints. At m = 0 it is not concave (the first rollout gains 0, the second
  2p(1 - p)), which is why min_per_prompt must be at least 1. Ties go to the lowest index, which
  makes equal predictions round-robin.

  Args:
    p_hat: f32[P] predicted success probability per prompt.
    budget: static int, total rollouts M_root.
    min_per_prompt: static int >= 1.
    max_per_prompt: static int or None (no cap).
    values: optional f32[P, cap + 1], the value of m = 0..cap rollouts per prompt
      (`root_value_table`), replacing V_root(p_hat, m); it must be concave in m from
      min_per_prompt on for the greedy to stay exact (the posterior and discovery tables are).

  Returns:
    i32[P] rollout counts m.

  Raises:
    ValueError: if the budget cannot be split under the bounds (checked on static values, so also
      under jit).

  Example:
    >>> p_hat = jnp.array([0.02, 0.5, 0.9])  # near-certain failure, coin flip, likely success
    >>> m = jax.jit(allocate_roots, static_argnums=(1, 2))(p_hat, 12, 2)  # budget 12, at least 2
    >>> m.tolist()
    [2, 5, 5]
  """
  p_hat = jnp.asarray(p_hat, jnp.float32)
  if p_hat.ndim != 1:
    raise ValueError(f"p_hat must be f32[P], got shape {p_hat.shape}")
  num_prompts = p_hat.shape[0]
  budget = int(budget)
  min_per_prompt = int(min_per_prompt)
  if min_per_prompt < 1:
    raise ValueError(
        f"min_per_prompt must be >= 1 (got {min_per_prompt}): a lone rollout is never mixed, so "
        "V_root is not concave at 0 and the greedy allocation would not be exact.")
  if budget < num_prompts * min_per_prompt:
    raise ValueError(
        f"budget {budget} < num_prompts {num_prompts} * min_per_prompt {min_per_prompt}")
  cap = budget if max_per_prompt is None else int(max_per_prompt)
  if cap < min_per_prompt:
    raise ValueError(f"max_per_prompt {cap} < min_per_prompt {min_per_prompt}")
  if budget > num_prompts * cap:
    raise ValueError(f"budget {budget} > num_prompts {num_prompts} * max_per_prompt {cap}")

  if values is not None:
    values = jnp.asarray(values, jnp.float32)
    if values.shape != (num_prompts, cap + 1):
      raise ValueError(f"values must be f32[{num_prompts}, {cap + 1}] (m = 0..max_per_prompt), "
                       f"got {values.shape}")
  return _greedy_roots(p_hat, values, budget, min_per_prompt, cap)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _greedy_roots(p_hat, values, budget, min_per_prompt, cap):
  """allocate_roots' program on checked inputs. Jitted at module level so that eager calls reuse
  one compilation per shape instead of retracing the loop's closure on every call."""
  num_prompts = p_hat.shape[0]
  p = jnp.clip(p_hat, 0.0, 1.0)
  m0 = jnp.full((num_prompts,), min_per_prompt, jnp.int32)
  rows = jnp.arange(num_prompts)

  def gain_of(m):
    if values is None:
      return _root_gain(p, m)
    nxt = jnp.minimum(m + 1, cap)
    return values[rows, nxt] - values[rows, m]

  def pick(_, m):
    gain = jnp.where(m < cap, gain_of(m), -jnp.inf)
    return m.at[jnp.argmax(gain)].add(1)

  return jax.lax.fori_loop(0, budget - num_prompts * min_per_prompt, pick, m0)


def allocate_roots_subset(p_hat, budget: int, num_selected: int, min_per_prompt: int = 2,
                          max_per_prompt: int | None = None, values=None):
  """Stage 1 over a candidate pool: which prompts get rollouts, and how many.

  Maximizes sum_i V_root(p_hat_i, m_i) subject to sum_i m_i = budget, exactly `num_selected`
  prompts with m_i > 0, and m_i in {0} U [min_per_prompt, max_per_prompt]. Scoring a pool larger
  than the step's batch costs one prefill per candidate and lets the budget go to the prompts whose
  groups are most likely to be mixed. The choice set is not concave at 0, so instead of greedy this
  is an exact dynamic program over (prompts seen, prompts selected, rollouts used), with
  O(P * num_selected * budget * (max - min + 1)) work, tested against brute force.

  Args:
    p_hat: f32[P] predicted success probability per candidate prompt.
    budget: static int, total rollouts M_root.
    num_selected: static int, prompts that receive rollouts (<= P).
    min_per_prompt: static int >= 1, rollouts of a selected prompt at least.
    max_per_prompt: static int or None (budget).
    values: optional f32[P, max - min + 1], the value of giving prompt i each count
      min_per_prompt..max_per_prompt (`root_value_table`), replacing V_root(p_hat, m). The program
      is exact for any table.

  Returns:
    i32[P] rollout counts (0 for prompts not selected). Ties prefer leaving a prompt out, then
    fewer rollouts, so equal predictions select the last prompts of the pool.

  Raises:
    ValueError: if the constraints admit no allocation.

  Example:
    >>> p_hat = jnp.array([0.05, 0.5, 0.95, 0.4])  # a pool of 4 candidate prompts
    >>> allocate_roots_subset(p_hat, budget=8, num_selected=2).tolist()  # the two most uncertain
    [0, 4, 0, 4]
  """
  p_hat = jnp.asarray(p_hat, jnp.float32)
  if p_hat.ndim != 1:
    raise ValueError(f"p_hat must be f32[P], got shape {p_hat.shape}")
  num_prompts, budget = p_hat.shape[0], int(budget)
  n_sel, lo = int(num_selected), int(min_per_prompt)
  hi = budget if max_per_prompt is None else int(max_per_prompt)
  if not 1 <= n_sel <= num_prompts:
    raise ValueError(f"num_selected must be in [1, {num_prompts}], got {n_sel}")
  if lo < 1 or hi < lo:
    raise ValueError(f"need 1 <= min_per_prompt <= max_per_prompt, got {lo}, {hi}")
  if not n_sel * lo <= budget <= n_sel * hi:
    raise ValueError(f"budget {budget} outside [{n_sel} * {lo}, {n_sel} * {hi}]: no allocation")
  counts = list(range(lo, hi + 1))
  if values is None:
    values = root_value(jnp.clip(p_hat, 0.0, 1.0)[:, None], jnp.asarray(counts)[None, :])
  values = jnp.asarray(values, jnp.float32)  # [P, K]
  if values.shape != (num_prompts, len(counts)):
    raise ValueError(f"values must be f32[{num_prompts}, {len(counts)}] (counts {lo}..{hi}), "
                     f"got {values.shape}")
  return _subset_program(values, budget, n_sel, lo)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _subset_program(values, budget, n_sel, lo):
  """allocate_roots_subset's dynamic program on checked inputs (values f32[P, K] for counts
  lo..lo+K-1). Jitted at module level: an eager call used to recompile the scan every time."""
  counts = list(range(lo, lo + values.shape[1]))
  neg = jnp.float32(-jnp.inf)
  best0 = jnp.full((n_sel + 1, budget + 1), neg).at[0, 0].set(0.0)

  def add_prompt(best, v):
    options = [best]  # option 0: the prompt gets no rollouts
    for j, m in enumerate(counts):
      shifted = jnp.full_like(best, neg).at[1:, m:].set(best[:-1, :budget + 1 - m])
      options.append(shifted + v[j])
    options = jnp.stack(options)
    return jnp.max(options, axis=0), jnp.argmax(options, axis=0).astype(jnp.int32)

  _, choice = jax.lax.scan(add_prompt, best0, values)  # choice: i32[P, n_sel + 1, budget + 1]
  lo_arr = jnp.int32(lo)

  def backtrack(state, ch):
    sel, used = state
    c = ch[sel, used]
    m = jnp.where(c == 0, 0, lo_arr + c - 1)
    return (sel - (c > 0).astype(jnp.int32), used - m), m

  _, m = jax.lax.scan(backtrack, (jnp.int32(n_sel), jnp.int32(budget)), choice, reverse=True)
  return m


def repeat_prob(p_hat, outcomes):
  """q_h = r p + (1 - r)(1 - p): chance one continuation from h repeats the outcome r. f32[H]."""
  p = jnp.clip(jnp.asarray(p_hat, jnp.float32), 0.0, 1.0)
  r = jnp.clip(jnp.asarray(outcomes, jnp.float32), 0.0, 1.0)
  return r * p + (1.0 - r) * (1.0 - p)


def prefix_objective(p_hat, outcomes, counts, valid):
  """Summed stage-2 objective sum_h valid_h (1 - q_h^{k_h}). Returns f32[]."""
  q = repeat_prob(p_hat, outcomes)
  v = 1.0 - q ** jnp.asarray(counts, jnp.float32)
  return jnp.sum(jnp.where(valid, v, 0.0))


def tree_aware_objective(p_hat, outcomes, counts, tree, tree_mixed, valid, lam=0.01):
  """Tree-aware stage-2 objective.

  sum over unmixed trees t of (1 - prod_{h in t} q_h^{k_h})  +  lam * sum over anchors h of mixed
  trees of (1 - q_h^{k_h}).

  Args:
    p_hat, outcomes, counts: [H] per anchor; tree: i32[H] tree index in [0, T); valid: bool[H].
    tree_mixed: bool[T] whether the tree's finished leaves already hold both outcomes.
    lam: weight of extra turn-level contrast in already mixed trees.

  Returns:
    f32[] objective value.
  """
  q = repeat_prob(p_hat, outcomes)
  k = jnp.asarray(counts, jnp.float32)
  tree = jnp.asarray(tree, jnp.int32)
  tree_mixed = jnp.asarray(tree_mixed, bool)
  valid = jnp.asarray(valid, bool)
  num_trees = tree_mixed.shape[0]
  log_prod = _tree_log_prod(q, k, tree, valid, num_trees)
  unmixed = jnp.sum(jnp.where(tree_mixed, 0.0, 1.0 - jnp.exp(log_prod)))
  per_anchor = jnp.where(valid & tree_mixed[jnp.clip(tree, 0, num_trees - 1)], 1.0 - q**k, 0.0)
  return unmixed + lam * jnp.sum(per_anchor)


def _tree_log_prod(q, k, tree, valid, num_trees):
  """log prod_{h in t} q_h^{k_h} per tree. f32[T]."""
  logq = jnp.log(jnp.maximum(q, _TINY))
  contrib = jnp.where(valid & (k > 0), k * logq, 0.0)
  seg = jnp.where(valid, tree, num_trees)  # Padding goes out of range and is dropped.
  return jnp.zeros((num_trees,), jnp.float32).at[seg].add(contrib, mode="drop")


def _summed_gain(k, q, _aux):
  """Marginal gain of V_pref(h, k) = 1 - q_h^k: q_h^k (1 - q_h)."""
  return q ** k.astype(jnp.float32) * (1.0 - q)


def _tree_gain(k, q, aux):
  """Marginal gain of the tree-aware objective (`allocate_prefixes_tree_aware`)."""
  tree, tree_mixed, valid, lam = aux
  num_trees = tree_mixed.shape[0]
  at = jnp.clip(tree, 0, num_trees - 1)
  kf = k.astype(jnp.float32)
  prod = jnp.exp(_tree_log_prod(q, kf, tree, valid, num_trees))
  unmixed_gain = prod[at] * (1.0 - q)
  mixed_gain = lam * q**kf * (1.0 - q)
  return jnp.where(tree_mixed[at], mixed_gain, unmixed_gain)


def _greedy(gain_fn, q, aux, costs, budget, valid, max_per_anchor, budget_unit, cost_aware):
  """Hands out continuations one at a time to the best marginal gain (per cost) that still fits.

  The whole budget is spent while any pick fits, even on near-zero gains, so methods compared at
  equal budget really sample equally much. Stops early only when nothing fits (every anchor at its
  cap, or every remaining cost above what is left of a token budget). `gain_fn(k, q, aux)` is a
  module-level function, so the jitted loop compiles once per shape, also when called eagerly.
  """
  if budget_unit not in ("rollouts", "tokens"):
    raise ValueError(f"budget_unit must be 'rollouts' or 'tokens', got {budget_unit!r}")
  return _greedy_program(gain_fn, q, aux, jnp.asarray(costs, jnp.float32),
                         jnp.asarray(budget, jnp.float32), jnp.asarray(valid, bool),
                         int(max_per_anchor), budget_unit, bool(cost_aware))


@functools.partial(jax.jit, static_argnums=(0, 6, 7, 8))
def _greedy_program(gain_fn, q, aux, costs, budget, valid, cap, budget_unit, cost_aware):
  num = costs.shape[0]
  spend = jnp.ones_like(costs) if budget_unit == "rollouts" else costs

  def cond(state):
    _, _, done = state
    return ~done

  def body(state):
    k, left, _ = state
    gain = gain_fn(k, q, aux)
    score = gain / costs if cost_aware else gain
    fits = valid & (k < cap) & (spend <= left)
    score = jnp.where(fits, score, -jnp.inf)
    i = jnp.argmax(score)
    ok = fits[i]
    k = k.at[i].add(ok.astype(jnp.int32))
    left = left - jnp.where(ok, spend[i], 0.0)
    return k, left, ~ok

  k0 = jnp.zeros((num,), jnp.int32)
  state = (k0, budget, jnp.asarray(cap <= 0))
  k, _, _ = jax.lax.while_loop(cond, body, state)
  return k


def allocate_prefixes(p_hat, outcomes, costs, budget, valid, max_per_anchor: int, *,
                      budget_unit: str = "rollouts", cost_aware: bool = True):
  """Stage 2, summed objective: continuations per candidate anchor.

  Greedy on the marginal gain of V_pref(h, k) = 1 - q_h^k, i.e. q_h^k (1 - q_h), divided by the cost
  of one continuation from h when `cost_aware`. V_pref is concave in k, so:
    - with budget_unit="rollouts" and cost_aware=False the greedy is exact;
    - with budget_unit="tokens" (a knapsack) the greedy value is at least OPT minus the largest
      single marginal gain (the fractional-knapsack bound: its picks up to the first one that does
      not fit are a prefix of an LP optimum);
    - with budget_unit="rollouts" and cost_aware=True each pick costs one rollout but is ranked by
      gain per expected token, trading some expected mixing for fewer generated tokens, as the
      method prescribes; this is not exact for the rollout-count objective.

  Args:
    p_hat: f32[H] predicted success probability of each candidate prefix.
    outcomes: f32[H] outcome r in [0, 1] of the rollout the prefix came from.
    costs: f32[H] expected tokens still to generate from h (> 0).
    budget: number of continuations ("rollouts") or generated tokens ("tokens"); may be traced.
    valid: bool[H] candidate mask.
    max_per_anchor: static int cap on continuations per anchor.
    budget_unit: "rollouts" or "tokens".
    cost_aware: rank by gain per cost (default) or by gain alone.

  Returns:
    i32[H] continuation counts.

  Example:
    >>> p_hat, outcomes = jnp.array([0.1, 0.5, 0.9]), jnp.zeros(3)  # anchors of failed rollouts
    >>> k = allocate_prefixes(p_hat, outcomes, jnp.ones(3), 4, jnp.ones(3, bool), max_per_anchor=3)
    >>> k.tolist()  # a near-sure flip needs one continuation; the coin flip gets the rest
    [0, 3, 1]
  """
  q = repeat_prob(p_hat, outcomes)
  return _greedy(_summed_gain, q, None, costs, budget, valid, max_per_anchor, budget_unit,
                 cost_aware)


def allocate_prefixes_tree_aware(p_hat, outcomes, costs, tree, tree_mixed, budget, valid,
                                 max_per_anchor: int, lam: float = 0.01, *,
                                 budget_unit: str = "rollouts", cost_aware: bool = True):
  """Stage 2, tree-aware objective (see `tree_aware_objective`): continuations per anchor.

  The marginal gain of one more continuation from anchor h is prod_t(k) (1 - q_h) in an unmixed tree
  t (prod_t = current prod_{h' in t} q_{h'}^{k_{h'}}), and lam q_h^{k_h} (1 - q_h) in a mixed one.

  Why greedy is a good heuristic here: per unmixed tree the value 1 - exp(sum_h k_h log q_h) is a
  concave function of a non-negative linear function of k, hence DR-submodular. Within a tree every
  pick multiplies the same prod_t, so with unit costs greedy fills the lowest-q anchors first, which
  is the best way to spend any number n of units on that tree, and the tree's best value is concave
  in n. The problem is then separable concave over trees and greedy is exact for a rollout budget
  ranked without costs (tested against brute force). With per-anchor costs it becomes a knapsack
  over a non-separable function and greedy-by-ratio is a heuristic without a general constant-factor
  bound; for single-anchor trees it reduces to the separable case and keeps the OPT - max gain bound
  of `allocate_prefixes` (tested).

  Args:
    p_hat, outcomes, costs, valid, max_per_anchor, budget, budget_unit, cost_aware: as in
      `allocate_prefixes`.
    tree: i32[H] tree index of each anchor, in [0, T).
    tree_mixed: bool[T] whether each tree's finished leaves already hold both outcomes.
    lam: weight of the per-anchor gain in already mixed trees (default 0.01, the run config's
      too). The tree term is the chance that an unmixed tree becomes mixed; a mixed tree has
      already earned it, so the per-anchor term there is a secondary goal (turn-level contrast
      inside a tree that already has contrast) and must not outrank an unmixed tree's gain,
      which for trees worth forking is rarely below a few hundredths: at 0.01 it orders anchors
      in mixed trees among themselves and takes the budget only when no unmixed tree can use it.

  Returns:
    i32[H] continuation counts.

  Example:
    >>> p_hat, outcomes = jnp.array([0.3, 0.6, 0.5]), jnp.array([0.0, 0.0, 1.0])
    >>> tree, tree_mixed = jnp.array([0, 0, 1]), jnp.array([False, True])  # tree 1 already mixed
    >>> allocate_prefixes_tree_aware(p_hat, outcomes, jnp.ones(3), tree, tree_mixed, 4,
    ...                              jnp.ones(3, bool), max_per_anchor=4).tolist()
    [0, 4, 0]
    >>> allocate_prefixes_tree_aware(p_hat, outcomes, jnp.ones(3), tree, tree_mixed, 4,
    ...                              jnp.ones(3, bool), max_per_anchor=4, lam=0.1).tolist()
    [0, 3, 1]
  """
  q = repeat_prob(p_hat, outcomes)
  tree = jnp.asarray(tree, jnp.int32)
  tree_mixed = jnp.asarray(tree_mixed, bool)
  valid = jnp.asarray(valid, bool)
  aux = (tree, tree_mixed, valid, jnp.asarray(lam, jnp.float32))
  return _greedy(_tree_gain, q, aux, costs, budget, valid, max_per_anchor, budget_unit,
                 cost_aware)


def blend_with_outcomes(p_hat, successes, trials, prior_strength):
  """Beta-posterior mean of a prefix's success probability given outcomes already seen under it.

  Prior Beta(s p_hat, s (1 - p_hat)) with s = prior_strength, observations `successes` out of
  `trials` (fractional rewards count fractionally): posterior mean
  (s p_hat + successes) / (s + trials). With no trials this is p_hat; with s = 0 it is the
  empirical rate.

  Args:
    p_hat: f32[H]; successes: f32[H]; trials: f32[H]; prior_strength: scalar or f32[H], >= 0.

  Returns:
    f32[H] blended probabilities.
  """
  p_hat = jnp.asarray(p_hat, jnp.float32)
  s = jnp.asarray(prior_strength, jnp.float32)
  trials = jnp.asarray(trials, jnp.float32)
  denom = s + trials
  post = (s * p_hat + jnp.asarray(successes, jnp.float32)) / jnp.where(denom > 0, denom, 1.0)
  return jnp.where(denom > 0, post, p_hat)



def anchor_posterior(p_anchor, p_root, successes, trials, prior_strength):
  """Success estimate of an anchor from its tree's own stage-1 outcomes and the predictor.

  The tree's prompt success rate gets a Beta posterior: prior Beta(s p_root, s (1 - p_root)) with
  s = prior_strength, updated with the tree's stage-1 `successes` out of `trials`, posterior mean
  p_tree = (s p_root + successes) / (s + trials). What the predictor says about the anchor beyond
  its prompt, p_anchor against p_root, then shifts that mean in logit space:
    logit(p_h) = logit(p_tree) + logit(p_anchor) - logit(p_root),
  so the root itself gets p_tree, an anchor the head rates above its prompt stays above it, and
  the result stays in (0, 1). The leaves of the same tree speak about the prompt more directly than
  the head does; the head still ranks anchors within a tree. prior_strength = 0 trusts the counts
  alone (where trials > 0); with no trials the result is p_anchor.

  Args:
    p_anchor: f32[H] predictor estimate at each anchor.
    p_root: f32[H] predictor estimate at the anchor's tree root.
    successes, trials: f32[H] stage-1 successes and rollouts of the anchor's tree.
    prior_strength: scalar >= 0.

  Returns:
    f32[H] posterior success probabilities, clipped to [1e-4, 1 - 1e-4].
  """
  lo, hi = 1e-4, 1.0 - 1e-4
  p_anchor = jnp.clip(jnp.asarray(p_anchor, jnp.float32), lo, hi)
  p_root = jnp.clip(jnp.asarray(p_root, jnp.float32), lo, hi)
  p_tree = jnp.clip(blend_with_outcomes(p_root, successes, trials, prior_strength), lo, hi)
  logit = lambda p: jnp.log(p) - jnp.log1p(-p)  # noqa: E731
  return jnp.clip(jax.nn.sigmoid(logit(p_tree) + logit(p_anchor) - logit(p_root)), lo, hi)


def platt_fit(p_hat, outcomes, prior_strength: float = 10.0, steps: int = 25):
  """Platt calibration of a predictor from (p̂, outcome) pairs: (a, b) such that
  sigmoid(a * logit(p̂) + b) matches the outcomes, under a Gaussian prior centred on the identity
  (a = 1, b = 0) whose weight equals `prior_strength` pairs, so a few pairs barely move it.

  Args:
    p_hat: f32[N] predicted success probabilities in (0, 1).
    outcomes: f32[N] observed rewards in {0, 1} (or in [0, 1]).
    prior_strength: pseudo-pairs of evidence for the identity map.
    steps: Newton steps (the problem is convex: 2 parameters, logistic loss + quadratic prior).
  Returns:
    (a, b) floats.

  >>> y = np.array([1.0] * 30 + [0.0] * 20 + [1.0] * 10 + [0.0] * 40)  # p̂ 0.9 -> 60% succeed
  >>> a, b = platt_fit(np.array([0.9] * 50 + [0.1] * 50), y)
  >>> bool(platt_apply(np.array([0.9]), a, b)[0] < 0.75)  # overconfident p̂ is pulled in
  True
  """
  p = np.clip(np.asarray(p_hat, np.float64), 1e-4, 1 - 1e-4)
  y = np.asarray(outcomes, np.float64)
  if p.shape != y.shape or p.ndim != 1:
    raise ValueError(f"p_hat {p.shape} and outcomes {y.shape} must be equal 1-D shapes")
  x = np.stack([np.log(p / (1 - p)), np.ones_like(p)], axis=1)
  theta, prior = np.array([1.0, 0.0]), np.array([1.0, 0.0])
  lam = float(prior_strength)

  def loss(t):  # penalized negative log-likelihood (convex)
    z = x @ t
    return float(np.sum(np.logaddexp(0, z) - y * z) + 0.5 * lam * np.sum((t - prior) ** 2))

  cur = loss(theta)
  for _ in range(steps):
    q = 1 / (1 + np.exp(-(x @ theta)))
    grad = x.T @ (q - y) + lam * (theta - prior)
    hess = (x * (q * (1 - q))[:, None]).T @ x + (lam + 1e-9) * np.eye(2)
    step = np.linalg.solve(hess, grad)
    t = 1.0  # backtracking: a plain Newton step overshoots on saturated logits
    while t > 1e-6 and loss(theta - t * step) > cur - 1e-4 * t * float(grad @ step):
      t *= 0.5
    if t <= 1e-6:
      break
    theta = theta - t * step
    new = loss(theta)
    if cur - new < 1e-10:
      break
    cur = new
  return float(theta[0]), float(theta[1])


def platt_apply(p_hat, a: float, b: float):
  """sigmoid(a * logit(p̂) + b), elementwise (numpy)."""
  p = np.clip(np.asarray(p_hat, np.float64), 1e-4, 1 - 1e-4)
  return (1 / (1 + np.exp(-(a * np.log(p / (1 - p)) + b)))).astype(np.float32)
