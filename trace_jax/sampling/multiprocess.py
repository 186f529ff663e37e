"""Sampling in a multi-process run: each process samples on its own devices, every process sees
every tree.

`ProcessShardedEngine` wraps one process's `SamplerEngine` (built on the process's block of the
global mesh, `parallel.local_mesh`) behind the engine's API. Every call is made by every process
with the same arguments (the driver, evaluation and the probe are deterministic functions of
globally agreed data); `run` splits the requests over the processes, each process samples its
share on its own devices (no cross-process program runs during sampling, so a slow retriever or
long turns on one host only make the others wait at the gather), and the trees are gathered so
that every process returns the same list, in request order:

- a new prompt goes to the process with the least work so far in the call (rollouts, largest
  requests first), and keeps that process for all its forks; its uid is its index among the
  call's prompts (from the engine's uid base), so its rollouts draw the rng streams they would on
  any process count;
- a tree sampled by another process is a host copy (a `Tree` is plain data; its KV pages and the
  engine's record of it stay with the owner's engine); a later fork on it runs on its owner, and
  the copy is brought up to date in place (the caller's references stay valid);
- `ledger` is the sum of every process's ledger; `prompt_features` splits the prompts and gathers
  the features; `release` frees the trees this process holds pages for and forgets the copies.

Allocation therefore stays global: stage 1 and stage 2 allocate over every prompt and anchor of
the step exactly as one process would, from the same inputs on every process.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from jax.sharding import NamedSharding, PartitionSpec as P

from trace_jax.parallel.distributed import allgather_object, local_mesh, to_local
from trace_jax.sampling.paged_kv import PoolLayout
from trace_jax.parallel.sharding import variable_value
from trace_jax.sampling.engine import SamplerEngine, sampling_shardings
from trace_jax.sampling.config import ForkRequest, Ledger, PromptRequest


def sampling_copy(params_state, mesh, num_kv_heads: int):
  """This process's copy of weights that live on the global `mesh` (an nnx State), in the layout
  its engine samples with: on its block of the mesh (`local_mesh`) as `SamplerEngine` places
  weights, or whole on its one device."""
  lm = local_mesh(mesh)
  is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
  if lm.size > 1:
    shardings = sampling_shardings(params_state, PoolLayout.for_mesh(lm, num_kv_heads))
  else:
    shardings = jax.tree.map(lambda v: NamedSharding(lm, P()), params_state, is_leaf=is_var)
  values = jax.tree.map(lambda v: variable_value(v) if is_var(v) else v, params_state,
                        is_leaf=is_var)
  targets = jax.tree.map(lambda v, sh: sh, params_state, shardings, is_leaf=is_var)
  local = to_local(values, mesh, targets)
  return jax.tree.map(lambda v, x: v.replace(x) if is_var(v) else x, params_state, local,
                      is_leaf=is_var)


def _fingerprint(reqs, uids) -> int:
  """A hash of a call's requests (what every process must agree on)."""
  return hash(tuple((u, r.n, tuple(map(int, r.prompt_ids))) if isinstance(r, PromptRequest) else
                    (u, int(getattr(r.node, "id", r.node)), r.k) for r, u in zip(reqs, uids)))


def _ledger_delta(after: dict, before: dict) -> dict:
  return {k: v - before.get(k, 0) for k, v in after.items()}


class ProcessShardedEngine:
  """A `SamplerEngine` over all processes of a run (see the module docstring).

  Args:
    engine: this process's engine, on this process's devices.
    mesh: the global mesh the trained weights live on (for `update_params`).
  """

  def __init__(self, engine: SamplerEngine, mesh):
    self.inner, self.mesh = engine, mesh
    self.rank, self.size = jax.process_index(), jax.process_count()
    self.ledger = Ledger()                 # every process's work, summed
    self._owner: dict[int, int] = {}       # tree uid -> the process holding its pages
    self._copies: dict[int, object] = {}   # uid -> host copy of another process's tree
    self._next_uid = 0

  # ---- the engine's API --------------------------------------------------------------------------
  @property
  def cfg(self):
    return self.inner.cfg

  @cfg.setter
  def cfg(self, value):  # evaluation's sampling_mode swaps the per-call settings
    self.inner.cfg = value

  def __getattr__(self, name):  # model_cfg, compile_counts, ... from this process's engine
    return getattr(self.__dict__["inner"], name)

  def set_uid_base(self, uid: int) -> None:
    self._next_uid = int(uid)
    self.inner.set_uid_base(uid)

  def update_params(self, params_state) -> None:
    """New weights from the global mesh, copied into this process's sampling layout."""
    self.inner.update_params(sampling_copy(params_state, self.mesh,
                                           self.inner.model_cfg.num_kv_heads))

  set_params = update_params

  def prompt_features(self, prompts, count_prefill: bool = True, keep: bool = False) -> np.ndarray:
    """The features of every prompt (each process computes a contiguous share; with `keep`, each
    keeps the K/V of its share, used where the prompt's tree is then placed on it)."""
    n = len(prompts)
    lo, hi = self.rank * n // self.size, (self.rank + 1) * n // self.size
    before = self.inner.ledger.as_dict()
    feats = self.inner.prompt_features(list(prompts[lo:hi]), count_prefill=count_prefill,
                                       keep=keep)
    parts = allgather_object((feats, _ledger_delta(self.inner.ledger.as_dict(), before)))
    self._add_ledger([d for _, d in parts])
    return np.concatenate([f for f, _ in parts])

  def run(self, requests, **kw) -> list:
    """Samples every request (each on one process) and returns every tree, as `SamplerEngine.run`
    would: the distinct trees in order of first request."""
    reqs = [ForkRequest(*r) if isinstance(r, tuple) else r for r in requests]
    owner, uid = [0] * len(reqs), [0] * len(reqs)
    load = np.zeros(self.size, np.int64)
    for i, r in enumerate(reqs):  # forks run where their tree's pages are
      if not isinstance(r, PromptRequest):
        uid[i] = r.tree.uid
        if uid[i] not in self._owner:
          raise ValueError(f"tree {uid[i]} was not sampled through this engine (or was released)")
        owner[i] = self._owner[uid[i]]
        load[owner[i]] += r.k
    prompts = [i for i, r in enumerate(reqs) if isinstance(r, PromptRequest)]
    for j, i in enumerate(prompts):
      uid[i] = self._next_uid + j
    for i in sorted(prompts, key=lambda i: -reqs[i].n):  # largest first, to the least loaded
      owner[i] = int(np.argmin(load))
      load[owner[i]] += reqs[i].n
    self.set_uid_base(self._next_uid + len(prompts))
    mine = [dataclasses.replace(r, uid=uid[i]) if isinstance(r, PromptRequest) else r
            for i, r in enumerate(reqs) if owner[i] == self.rank]
    before = self.inner.ledger.as_dict()
    trees = self.inner.run(mine, **kw) if mine else []
    local = {t.uid: t for t in trees}
    delta = _ledger_delta(self.inner.ledger.as_dict(), before)
    parts = allgather_object((trees, delta, _fingerprint(reqs, uid)))
    if any(f != parts[0][2] for _, _, f in parts):
      raise RuntimeError("the processes issued different sampling requests (their allocations "
                         "diverged); a multi-process run needs every host decision to agree")
    self._add_ledger([d for _, d, _ in parts])
    for p, (ts, _, _) in enumerate(parts):
      for t in ts:
        self._owner[t.uid] = p
        if p == self.rank:
          continue
        if t.uid in self._copies:  # bring the caller's copy up to date in place
          held = self._copies[t.uid]
          held.meta, held.nodes = t.meta, t.nodes
        else:
          self._copies[t.uid] = t
    out, seen = [], set()
    for i, r in enumerate(reqs):
      if uid[i] in seen:
        continue
      seen.add(uid[i])
      if owner[i] == self.rank:
        out.append(local[uid[i]] if uid[i] in local else r.tree)
      else:
        out.append(self._copies[uid[i]])
    return out

  def release(self, trees=None) -> None:
    """Frees this process's pages of `trees` (every tree if None) and forgets the copies."""
    if trees is None:
      self.inner.release(None)
      self._owner.clear()
      self._copies.clear()
      return
    trees = list(trees)
    self.inner.release([t for t in trees if self._owner.get(t.uid) == self.rank])
    for t in trees:
      self._owner.pop(t.uid, None)
      self._copies.pop(t.uid, None)

  def _add_ledger(self, deltas) -> None:
    for d in deltas:
      for k, v in d.items():
        setattr(self.ledger, k, getattr(self.ledger, k) + v)


__all__ = ["ProcessShardedEngine", "sampling_copy"]
