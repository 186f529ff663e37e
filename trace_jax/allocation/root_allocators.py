"""TRACE stage 1: how many rollouts each prompt root gets.

`allocate_roots` maximizes sum_i V_root(p_i, m_i) (`root_values.root_value`, or any concave
table of `root_values.root_value_table`) over every prompt by greedy picks, exact for this
separable concave problem; `allocate_roots_subset` also chooses which prompts of a candidate pool
get rollouts, by an exact dynamic program. Both are pure and jittable and return i32 counts; the
greedy loop runs one pick per iteration, O(num_prompts) work each.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from trace_jax.allocation.root_values import root_value


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
