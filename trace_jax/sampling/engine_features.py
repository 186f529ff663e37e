"""Predictor features in the tree sampler (`sampling.engine`): scoring prompts before sampling
them (`SamplerEngine.prompt_features`, optionally keeping their K/V pages for the next `run`), a
node's feature from its final hidden state (`_node_feature`) and the per-tree prompt means
(`prompt_mean_features`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from trace_jax.models.predictor import feature_width
from trace_jax.sampling import slot_tables
from trace_jax.sampling.engine_pages import TreeState
from trace_jax.sampling.paged_kv import PoolExhaustedError

_PROMPT_MEANS_KEPT = 4096  # prompt means cached between weight updates


class PromptFeaturesMixin:
  """`SamplerEngine`'s prompt scoring and node features. Uses the engine's `cfg`, `model_cfg`,
  `alloc`, `shards`, `state`, `buckets`, `prefill_rows`, `ledger`, `_features`, `_jobs`,
  `_kept`, `_scored` and `_prompt_means` (set by `SamplerEngine.__init__`), `_flush_prefill`
  (`engine_loop.DecodeLoopMixin`) and `_charge` (`engine_admission.AdmissionMixin`)."""

  def prompt_features(self, prompts: Sequence[Sequence[int]],
                      count_prefill: bool = True, keep: bool = False) -> np.ndarray:
    """Predictor features of prompts before sampling them: f32[N, D], the final hidden state at
    each prompt's last token (what the engine records as `tree.root.feature`; with
    `prompt_mean_features` f32[N, 2D], that state and the mean final state over the prompt).
    Batches of `prefill_batch` rows (on a mesh: rounded up to whole rows per data shard, the
    rows split over the shards), lengths padded to the page-table buckets (in tokens). The prompt
    tokens count as prefill in the ledger unless `count_prefill` is False (work that is not
    sampling, e.g. re-featurizing the predictor's training prompts).

    keep: score the prompts with the sampler's own chunked prefill into KV pages and keep those
    pages for the prompts the next `run` admits (the others are released as it starts, or at
    `update_params`; a prompt scored again gets new pages, its old ones go back; a pool scored
    for a step ahead keeps the current step's): a candidate pool is prefilled once,
    whichever of its prompts are then sampled. Prompts that do not fit in the free pages are
    scored the plain way. The features agree with the plain way's to float rounding. An error
    (a prompt of a bad length, a failed prefill) keeps no page of the call.

    The prefill is charged to `ledger` now, unless a later `run` starts rollouts ahead (`ahead`)
    from this pool (all their prompts scored here, under the current weights): then it moves to
    `ahead_ledger`, the cost of the step that adopts them."""
    if keep and not count_prefill:
      raise ValueError("keep=True prefills for sampling; its tokens count as prefill")
    before = self.ledger.prefill_tokens
    out = self._score_and_keep(prompts) if keep else self._plain_features(prompts, count_prefill)
    spent = self.ledger.prefill_tokens - before
    if spent:
      scored = frozenset(tuple(int(t) for t in p) for p in prompts)
      self._scored = (self._scored + [(scored, spent)])[-8:]
    return out

  def _score_and_keep(self, prompts) -> np.ndarray:
    cfg = self.cfg
    keys = [tuple(int(t) for t in p) for p in prompts]
    for key in keys:  # before any page is taken
      if not 1 <= len(key) < cfg.max_seq_len:
        raise ValueError(f"prompt length {len(key)} not in [1, max_seq_len={cfg.max_seq_len})")
    for key in set(keys) & set(self._kept):  # scored again: the older pages go back
      self.alloc.decref(self._kept.pop(key)[0])
    jobs, plain = {}, []
    try:
      for i, key in enumerate(dict.fromkeys(keys)):
        try:
          pages = self.alloc.alloc(-(-len(key) // cfg.page_size), i % self.shards)
        except PoolExhaustedError:
          plain.append(key)
          continue
        # [branch, pages, start, tokens, features]: the whole prompt, its last token included
        # (the first decode step writes that token's K/V again, identically), for its final state.
        jobs[key] = [None, pages, 0, list(key), {"last": None, "sum": 0.0}]
      self._jobs.extend(jobs.values())
      self._flush_prefill()
    except BaseException:  # no page of this call stays taken, no job of it queued
      mine = {id(j) for j in jobs.values()}
      self._jobs = [j for j in self._jobs if id(j) not in mine]
      for job in jobs.values():
        self.alloc.decref(job[1])
      raise
    feats = {}
    d = self.model_cfg.hidden_size
    for key, job in jobs.items():
      acc = job[4]
      f = acc["last"]
      if cfg.prompt_mean_features:
        mean = np.asarray(acc["sum"], np.float32) / len(key)
        self._prompt_means[key] = mean
        f = np.concatenate([f, mean])
      feats[key] = np.asarray(f, np.float32)
      self._kept[key] = (job[1], len(key) - 1)
    if plain:
      for key, f in zip(plain, self._plain_features(plain, True)):
        feats[key] = f
    width = feature_width(d, "last+prompt_mean" if cfg.prompt_mean_features else "last")
    return (np.stack([feats[k] for k in keys]) if keys else np.zeros((0, width), np.float32))

  def _plain_features(self, prompts, count_prefill: bool) -> np.ndarray:
    cfg = self.cfg
    rows = self.prefill_rows * self.shards
    out = []
    for i in range(0, len(prompts), rows):
      chunk = [list(p) for p in prompts[i:i + rows]]
      width = slot_tables.pick_bucket(-(-max(map(len, chunk)) // cfg.page_size), self.buckets)
      tokens = np.zeros((rows, width * cfg.page_size), np.int32)
      lens = np.zeros(rows, np.int32)
      for r, p in enumerate(chunk):
        tokens[r, :len(p)], lens[r] = p, len(p)
      out.append(np.asarray(self._features(self.state, tokens, lens))[:len(chunk)])
      if cfg.prompt_mean_features:
        d = self.model_cfg.hidden_size
        for p, f in zip(chunk, out[-1]):
          self._prompt_means[tuple(p)] = f[d:]
      if count_prefill:  # scoring prompts for allocation is prefill work too
        self.ledger.prefill_tokens += int(lens.sum())
    d = feature_width(self.model_cfg.hidden_size,
                      "last+prompt_mean" if cfg.prompt_mean_features else "last")
    return np.concatenate(out) if out else np.zeros((0, d), np.float32)

  def _node_feature(self, st: TreeState, hidden) -> np.ndarray:
    """A node's predictor feature from the final state at its last token: that state, and with
    `prompt_mean_features` the tree's prompt mean after it (computed once per tree)."""
    h = np.asarray(hidden, np.float32)
    if not self.cfg.prompt_mean_features:
      return h
    if st.prompt_mean is None:  # (admission sets it; kept as a guard)
      self._set_prompt_means([st])
    return np.concatenate([h, st.prompt_mean])

  def _set_prompt_means(self, states: Sequence[TreeState]) -> None:
    """Each tree's mean final state over its prompt: from the prompts scored under the current
    weights, else one batched plain forward over the others (prefill work)."""
    missing = [st.tree.prompt_ids for st in states
               if tuple(st.tree.prompt_ids) not in self._prompt_means]
    if missing:  # the prefill of the trees' admission: their ledger (`ahead_ledger` for ahead)
      before = self.ledger.prefill_tokens
      self._plain_features(missing, True)
      ledger = self._charge(states[0])
      if ledger is not self.ledger:
        ledger.prefill_tokens += self.ledger.prefill_tokens - before
        self.ledger.prefill_tokens = before
    for st in states:
      st.prompt_mean = np.asarray(self._prompt_means[tuple(st.tree.prompt_ids)], np.float32)
    if len(self._prompt_means) > _PROMPT_MEANS_KEPT:  # scored pools of past calls
      self._prompt_means.clear()
