"""The decode/prefill loop of the tree sampler (`sampling.engine`): the host iteration of
`SamplerEngine.run` (`_loop`), the chunked prefill of queued jobs (`_flush_prefill`), the pages
and step budget of each decoding slot (`_ensure_pages`), one multi-step decode call over every
busy slot (`_step`), and turn ends: the environment call, observation prefills and finished
branches (`_end_turns`).
"""

from __future__ import annotations

import jax
import numpy as np

from trace_jax.sampling import slot_tables
from trace_jax.sampling.config import TurnRef
from trace_jax.sampling.engine_pages import _Branch
from trace_jax.sampling.observation import fit_observation_ids


class DecodeLoopMixin:
  """`SamplerEngine`'s host loop. Uses the engine's `cfg`, `alloc`, `shards`, `slots`, `state`,
  `pool`, `chunks`, `buckets`, `prefill_rows`, `groups_per_shard`, `layout`, `stop_width`,
  `stop_strings`, `eos_id`, `encode`, `decode`, `env_step`, `observation_close`, `turn_limit_fn`,
  `record_steps`, `step_log`, `slot_worker`, `slot_shard`, `ledger`, `_decode`, `_prefill`,
  `_jobs`, `_pending`, `_idle`, `_on_trees_done` and `_run_trees` (set by `SamplerEngine.__init__`
  and `run`), with the admission (`engine_admission.AdmissionMixin`), page
  (`engine_pages.PageBookkeepingMixin`) and feature (`engine_features.PromptFeaturesMixin`)
  methods."""

  # ---- main loop ---------------------------------------------------------------------------------
  def _loop(self, sync_turns, num_workers, sync_refill=False):
    while True:
      if not self._idle and not self._own_work_left():
        self._flush_prefill()  # the ahead branches' queued observations: their K/V complete
        return  # this run's trees are done; the ones started ahead stay as they are
      if self._idle:  # the caller's next requests for trees that just finished
        idle, self._idle = self._idle, []
        more = list(self._on_trees_done(idle) or [])
        if more:  # new prompts' trees join the run's result, after the others
          self._run_trees += [t for t in self._admit(more, num_workers)
                              if all(t is not u for u in self._run_trees)]
      if not sync_turns or all(b is None for b in self.slots):
        self._refill()
      self._flush_prefill()
      decoding = [i for i, b in enumerate(self.slots) if b is not None and not b.waiting]
      if not decoding:
        waiting = [i for i, b in enumerate(self.slots) if b is not None]
        if waiting:  # synchronous barrier reached: every slot's turn has ended
          self._end_turns(waiting)
          if sync_refill:  # new branches join at the barrier and start their first turn in step
            self._refill()
          continue
        if self._idle:  # trees whose last branches the pool could not start: report them
          continue
        if any(self._pending.values()):
          raise RuntimeError("pending branches but no slot could start one")  # not reachable
        return
      decoding = self._ensure_pages(decoding)
      if decoding:
        self._step(decoding, num_workers, sync_turns)

  def _flush_prefill(self):
    """Runs queued prefill jobs [owner, pages, start, tokens, features|None(, redo)] (owner: the
    branch or TreeState the work is charged to, None for scoring; redo: how many of the leading
    tokens rewrite K/V given back to make room, `recomputed_tokens`) in chunk/row
    buckets (a job with a features dict gets its final state at its last token and the sum of
    its final states, `prompt_features(keep=True)`); on a
    mesh each call holds a block of `prefill_rows` rows per data shard, each shard's own jobs."""
    cfg, jobs = self.cfg, [j for j in self._jobs if j[3]]
    # Jobs stay listed until written: after an error, `run` finds the K/V that never was.
    self._jobs = jobs
    n, d_count = self.prefill_rows, self.shards
    while jobs:
      by_shard = [[] for _ in range(d_count)]
      for j in jobs:
        q = by_shard[self.alloc.shard_of(j[1][0])]
        if len(q) < n:
          q.append(j)
      picked = [(d, r, j) for d in range(d_count) for r, j in enumerate(by_shard[d])]
      take = {id(j): min(len(j[3]), self.chunks[-1]) for _, _, j in picked}
      c = slot_tables.pick_bucket(max(take.values()), self.chunks)
      width = slot_tables.pick_bucket(
          max(-(-(j[2] + take[id(j)]) // cfg.page_size) for _, _, j in picked), self.buckets)
      rows = n * d_count
      table = np.zeros((rows, width), np.int32)
      for d in range(d_count):
        table[d * n:(d + 1) * n] = self.alloc.null_page(d)
      batch = {"tokens": np.zeros((rows, c), np.int32), "table": table,
               "start": np.zeros(rows, np.int32), "num_new": np.zeros(rows, np.int32)}
      rows_of = []
      for d, r, j in picked:
        t, r = take[id(j)], d * n + r
        batch["tokens"][r, :t] = j[3][:t]
        batch["table"][r, :min(len(j[1]), width)] = j[1][:width]
        batch["start"][r], batch["num_new"][r] = j[2], t
        rows_of.append((r, j))
      self.pool, last, total = self._prefill(self.state, self.pool, batch)
      for _, j in rows_of:  # written: the jobs move on
        t = take[id(j)]
        j[2] += t
        j[3] = j[3][t:]
        owner = j[0].state if isinstance(j[0], _Branch) else j[0]
        redo = min(t, j[5]) if len(j) > 5 else 0  # K/V given back to make room, written again
        if redo:
          j[5] -= redo
          self._charge(owner).recomputed_tokens += redo
        self._charge(owner).prefill_tokens += t - redo
      if any(j[4] is not None for _, j in rows_of):  # scoring: read the rows' final states
        last, total = np.asarray(last), np.asarray(total)
        for r, j in rows_of:
          if j[4] is not None:
            j[4]["last"], j[4]["sum"] = last[r], j[4]["sum"] + total[r]
      jobs = self._jobs = [j for j in jobs if j[3]]

  def _budget(self, b: _Branch) -> int:
    """Decode steps of the next call: up to decode_steps, never past the turn or sequence limit."""
    if b.final:
      return 1
    return max(1, min(self.cfg.decode_steps, b.turn_limit - len(b.turn_ids),
                      self.cfg.max_seq_len - 1 - b.kv_len))

  def _ensure_pages(self, decoding):
    """Gives each decoding slot a page for its next write, oldest branch first, making room as
    `engine_preempt` says (a branch it preempts leaves `decoding`; one the shard cannot hold
    even alone is cut), then pages for the rest of its step budget as far as the free pages
    allow (the budget shrinks to the pages it got)."""
    ok, cut, ps = [], [], self.cfg.page_size
    for i in sorted(decoding, key=lambda i: self.slots[i].seq):
      b = self.slots[i]
      if b is None:  # preempted for an older branch
        continue
      if b.kv_len // ps >= len(b.pages):
        if not self._make_room(b.shard, 1, requester=b):
          if self._others_on_shard(b):  # the others progress; this one resumes after
            self._preempt(i)
            continue
          if b.final:  # the leaf is complete; only its feature is lost
            self._retire(i)
            continue
          b.end_reason = "pool_exhausted"  # the shard cannot hold this branch alone
          cut.append(i)
          continue
        b.pages.extend(self.alloc.alloc(1, b.shard))
      ok.append(i)
    ok = [i for i in ok if self.slots[i] is not None]
    for i in ok:
      b = self.slots[i]
      b.budget = self._budget(b)
      more = (b.kv_len + b.budget - 1) // ps + 1 - len(b.pages)
      if more > 0:
        b.pages.extend(self.alloc.alloc(min(more, self.alloc.num_free_in(b.shard)), b.shard))
        b.budget = min(b.budget, len(b.pages) * ps - b.kv_len)
    if cut:
      self._end_turns(cut)
    return sorted(ok)

  def _step(self, decoding, num_workers, sync_turns):
    cfg, s, ps = self.cfg, self.cfg.num_slots, self.cfg.page_size
    k_steps, width = cfg.decode_steps, self.stop_width
    views: list = [None] * s
    batch = {k: np.zeros(s, np.int32) for k in ("tokens", "positions", "budget", "counters",
                                                 "top_k")}
    null = np.asarray([self.alloc.null_page(int(d)) for d in self.slot_shard], np.int32)
    batch["null"] = null
    batch["write_pages"] = np.repeat(null[:, None], (ps + k_steps - 2) // ps + 1, axis=1)
    batch["window"] = np.full((s, width), -2, np.int32)
    batch["keys"] = np.zeros((s, 2), np.uint32)
    batch["temperature"] = np.full(s, cfg.temperature, np.float32)
    batch["top_p"] = np.full(s, cfg.top_p, np.float32)
    batch["top_k"][:] = cfg.top_k
    batch["greedy"] = np.full(s, cfg.greedy, bool)
    for i in decoding:
      b = self.slots[i]
      batch["tokens"][i], batch["positions"][i] = b.pending, b.kv_len
      own = b.pages[b.kv_len // ps:(b.kv_len + b.budget - 1) // ps + 1]
      batch["write_pages"][i, :len(own)] = own
      batch["budget"][i] = b.budget
      recent = b.turn_ids[-width:]
      if recent:
        batch["window"][i, width - len(recent):] = recent
      batch["keys"][i], batch["counters"][i] = b.key, b.counter
      views[i] = slot_tables.SlotView(b.pages, b.kv_len + 1, b.group_key, b.shared_pages)
    if self.layout is not None:
      batch.update(slot_tables.sharded_tables(
          views, self.shards, self.alloc.pages_per_shard, ps, self.groups_per_shard,
          cfg.group_size, self.buckets, tree=cfg.use_tree_attention))
    elif cfg.use_tree_attention:
      batch.update(slot_tables.tree_tables(views, ps, cfg.num_groups, cfg.group_size,
                                           self.buckets))
    else:
      batch.update(slot_tables.plain_tables(views, self.buckets))
    self.pool, out = self._decode(self.state, self.pool, batch)
    out = jax.device_get(out)
    counts = np.asarray(out["count"])
    n_steps = int(counts[decoding].max())
    for j in range(n_steps if self.record_steps else 0):
      busy = np.zeros(num_workers, np.int32)
      live = [i for i in decoding if counts[i] > j]
      np.add.at(busy, self.slot_worker[live], 1)
      self.step_log.append(busy)
    self.ledger.decode_steps += n_steps
    self.ledger.busy_slot_steps += int(counts[decoding].sum())
    self.ledger.total_slot_steps += s * n_steps
    self.ledger.empty_slot_steps += (s - len(decoding)) * n_steps
    ended = []
    for i in decoding:
      b = self.slots[i]
      if b.feature_for is not None:
        b.tree.nodes[b.feature_for].feature = self._node_feature(b.state, out["hidden"][i])
        b.feature_for = None
      if b.final:
        b.kv_len += 1
        self._retire(i)
        continue
      new = [int(t) for t in out["tokens"][i, :counts[i]]]
      # One detokenize per slot and call: only a stop string somewhere in the new tokens' text
      # makes the token-by-token check below look for it.
      start = len(b.turn_ids)
      text_stop = bool(self.stop_strings) and any(
          x in self.decode((b.turn_ids + new)[max(0, start - 15):]) for x in self.stop_strings)
      for j, tok in enumerate(new):
        # Tokens past a turn end the device did not see are dropped: the branch's K/V, rng
        # counter and length stay those of the turn's last token (later writes overwrite them).
        b.kv_len += 1
        b.turn_ids.append(tok)
        b.turn_lps.append(float(out["logprobs"][i, j]))
        b.turn_ents.append(float(out["entropy"][i, j]))
        b.counter += 1
        b.pending = tok
        self._charge(b.state).generated_tokens += 1
        if self.eos_id is not None and tok == self.eos_id:
          b.end_reason = "stop"
        elif text_stop and any(x in self.decode(b.turn_ids[-16:]) for x in self.stop_strings):
          b.end_reason = "stop"
        elif len(b.turn_ids) >= b.turn_limit:
          b.end_reason = "turn_limit"
        elif b.kv_len + 1 >= cfg.max_seq_len:
          b.end_reason = "max_seq_len"
        if b.end_reason:
          ended.append(i)
          break
      if b.stale_kv:  # new weights over K/V written under replaced ones: neither policy's tokens
        b.tree.meta["stale_tokens"] = (b.tree.meta.get("stale_tokens", 0)
                                       + len(b.turn_ids) - start)
    if sync_turns:
      for i in ended:
        self.slots[i].waiting = True
    elif ended:
      self._end_turns(ended)

  # ---- turn ends ---------------------------------------------------------------------------------
  def _end_turns(self, idx):
    """Records the turn nodes of slots `idx`, runs the environment, queues observation prefills."""
    cfg, calls = self.cfg, []
    for i in idx:
      self.slots[i].ending = True  # not a victim for the observations' pages (`engine_preempt`)
    for i in idx:
      b = self.slots[i]
      b.waiting = False
      ids = b.turn_ids[:-1] if b.turn_ids and b.turn_ids[-1] == self.eos_id else b.turn_ids
      b.node = b.tree.add_node(b.parent_node, gen_ids=b.turn_ids, logprobs=b.turn_lps,
                               entropies=b.turn_ents, text=self.decode(ids) if ids else "",
                               rollout=b.serial)
      if b.end_reason in ("stop", "turn_limit"):
        calls.append(i)
      else:
        b.node.done, b.node.truncated, b.node.reward = True, b.end_reason, cfg.truncation_reward
    results = self.env_step([(TurnRef(self.slots[i].tree, self.slots[i].node),
                              self.slots[i].node.text) for i in calls]) if calls else []
    for i in calls:
      self._charge(self.slots[i].state).tool_calls += 1
    for i, (obs, done, reward) in zip(calls, results):
      b = self.slots[i]
      node = b.node
      if done:
        node.done, node.reward = True, float(reward or 0.0)
      elif node.depth >= cfg.max_turns:
        node.done, node.truncated, node.reward = True, "max_turns", cfg.truncation_reward
      else:
        self._add_observation(b, obs or "")
    for i in idx:
      b = self.slots[i]
      if b is None:  # preempted for its observation's pages (`_preempt_after_observation`)
        continue
      b.ending = False
      b.turn_ids, b.turn_lps, b.turn_ents, b.end_reason = [], [], [], ""
      if b.node.done:
        self._finish(i)
      else:
        b.parent_node, b.feature_for = b.node.id, b.node.id
        b.turn_limit = self._turn_limit(b)

  def _add_observation(self, b: _Branch, obs_text: str):
    cfg, node = self.cfg, b.node
    room = cfg.max_seq_len - (b.kv_len + 1) - 1  # keep room to generate at least one token
    obs = self._fit_observation(obs_text, max(0, min(cfg.max_obs_tokens, room)))
    node.obs_ids, node.obs_text = obs, obs_text
    if room <= 0:
      node.done, node.truncated, node.reward = True, "max_seq_len", cfg.truncation_reward
      return
    if obs:
      tokens = [b.pending] + obs[:-1]
      need = max(0, -(-(b.kv_len + len(tokens)) // cfg.page_size) - len(b.pages))
      if not self._make_room(b.shard, need, requester=b):
        if self._others_on_shard(b):  # resumes later from this node, observation included
          self._preempt_after_observation(b, tokens, obs[-1])
          return
        node.done, node.truncated, node.reward = True, "pool_exhausted", cfg.truncation_reward
        return
      b.pages.extend(self.alloc.alloc(need, b.shard))
      self._jobs.append([b, b.pages, b.kv_len, tokens, None])
      b.kv_len += len(tokens)
      b.pending = obs[-1]
    b.state.kv[node.id] = (b.pages, b.kv_len)  # written by the queued job (`_drop_unwritten`)
    if b.stale_kv:
      b.state.old_kv.add(node.id)

  def _fit_observation(self, obs_text: str, limit: int) -> list[int]:
    """At most `limit` token ids of the observation; a cut keeps the caller's
    `observation_close` marker last (see `sampling.observation.fit_observation_ids`)."""
    return fit_observation_ids(self.encode, obs_text, limit, self.observation_close)

  def _finish(self, i):
    b = self.slots[i]
    if self.cfg.leaf_features and b.node.feature is None:
      b.final, b.feature_for = True, b.node.id  # one more step feeds the last token
    else:
      self._retire(i)

  def _turn_limit(self, b: _Branch) -> int:
    if self.turn_limit_fn is None:
      return self.cfg.max_turn_tokens
    depth = b.tree.nodes[b.parent_node].depth + 1
    return max(1, min(self.cfg.max_turn_tokens, int(self.turn_limit_fn(b.tree, b.serial, depth))))
