"""Preemption in the tree sampler (`sampling.engine`): what the engine does when a branch needs a
KV page and its data shard has none free. Nothing is cut while the pool can hold the branch alone.

The policy, in order (`_make_room`):
1. **Evict cached K/V.** A tree keeps the pages of its finished branches (and its prompt's) so
   later forks share them. Those caches are given back first, whole trees at a time: trees with
   no branch queued or decoding first, then the others (lowest uid first). The nodes whose K/V
   goes are remembered (`TreeState.evicted`): a later fork from one prefills its prefix again.
2. **Preempt a decoding branch** (only for a branch that must write its next token or its
   observation, never for one waiting to start): the victim is the most recently started branch
   on the shard that started after the one in need (first-come first-served: the oldest branch
   always progresses, so no two branches preempt each other forever). The victim keeps its
   tokens, rng stream and counters, gives back every page reference it holds and goes back to
   the head of its queue. When pages allow it resumes: its K/V is recomputed by a prefill of its
   tokens (sharing its anchor's full pages when they are still cached) and it decodes on as if
   nothing happened. If no branch started later is decoding, the branch in need preempts itself
   while other branches on its shard can make progress.
3. Only when the shard cannot hold the branch even alone (pages held outside the engine's
   trees) is it cut as a `pool_exhausted` leaf, a system cut the training loop leaves out.

Each branch draws from its own rng stream, so a pool a fraction of the need samples the same
tokens as an ample one, only slower; the recomputed K/V comes from a prefill rather than the decode
step that first wrote it, equal up to floating-point rounding. Preemptions, recomputed tokens and
the peak of pages in use are counted (`Ledger.preemptions`, `Ledger.recomputed_tokens`,
`PageAllocator.peak`).
"""

from __future__ import annotations

from trace_jax.sampling.engine_pages import TreeState, _Branch


class PreemptionMixin:
  """`SamplerEngine`'s room-making for a full shard. Uses the engine's `cfg`, `alloc`, `slots`,
  `slot_worker`, `slot_shard`, `_trees`, `_pending`, `_ahead_pending`, `_copies` (set by
  `SamplerEngine.__init__` and `run`), `_flush_prefill` (`engine_loop.DecodeLoopMixin`),
  `_flush_copies` and `_charge` (`engine_admission.AdmissionMixin`)."""

  def _make_room(self, shard: int, need: int, requester: _Branch | None = None,
                 protect: TreeState | None = None) -> bool:
    """Frees pages on `shard` until `need` are free: cached K/V first (not `protect`'s), then,
    for a decoding `requester`, branches started after it. True when `need` pages are free."""
    if self.alloc.num_free_in(shard) >= need:
      return True
    self._flush_prefill()  # queued writes and copies first: nothing frees a page they touch
    self._flush_copies()
    while self.alloc.num_free_in(shard) < need:
      if self._evict_one(shard, protect):
        continue
      victim = self._victim(shard, requester) if requester is not None else None
      if victim is None:
        return False
      self._preempt(victim)
    return True

  def _evict_one(self, shard: int, protect: TreeState | None) -> bool:
    """Evicts the cached K/V of one tree on `shard` that frees at least one page there."""
    order = sorted((st for st in self._trees.values()
                    if st.shard == shard and st is not protect and any(st.page_refs)),
                   key=lambda st: (st.outstanding > 0, st.tree.uid))
    for st in order:
      held: dict[int, int] = {}
      for pages in st.page_refs:
        for p in pages:
          held[p] = held.get(p, 0) + 1
      if any(self.alloc.refcount[p] == n for p, n in held.items()):
        self._evict(st)
        return True
    return False

  def _evict(self, st: TreeState) -> None:
    """Gives back every page reference `st` holds; its nodes whose K/V lived there become
    `evicted` (a fork from one recomputes it). The reference list keeps its length (empty
    entries), so `rollback` marks stay valid."""
    lists = {id(p) for p in st.page_refs}
    for nid in [k for k, (p, _) in st.kv.items() if id(p) in lists]:
      del st.kv[nid]
      st.evicted.add(nid)
    for i, pages in enumerate(st.page_refs):
      self.alloc.decref(pages)
      st.page_refs[i] = []

  def _victim(self, shard: int, requester: _Branch) -> int | None:
    """The slot of the most recently started decoding branch on `shard` started after
    `requester` (branches waiting at a barrier, ending a turn or recording a leaf's feature
    excepted), or None."""
    best = None
    for i, b in enumerate(self.slots):
      if (b is None or b is requester or b.waiting or b.final or b.ending
          or b.shard != shard or b.seq < requester.seq):
        continue
      if best is None or b.seq > self.slots[best].seq:
        best = i
    return best

  def _others_on_shard(self, b: _Branch) -> bool:
    return any(o is not None and o is not b and o.shard == b.shard for o in self.slots)

  def _preempt(self, i: int) -> None:
    """Takes the branch in slot `i` out: its pages go back, its tokens stay, and it waits at the
    head of its queue (in start order among other preempted branches) to resume."""
    b = self.slots[i]
    st = b.state
    lost = [(nid, n) for nid, (p, n) in st.kv.items() if p is b.pages]
    for nid, _ in lost:  # nodes it recorded: their K/V lived in its pages
      del st.kv[nid]
    b.rekv = b.rekv + lost
    self.alloc.decref(b.pages)
    b.pages, b.budget = [], 0
    self.slots[i] = None
    key = (int(self.slot_worker[i]), int(self.slot_shard[i]))
    q = (self._ahead_pending if st.ahead else self._pending)[key]
    at = 0
    while at < len(q) and isinstance(q[at][1], _Branch) and q[at][1].seq < b.seq:
      at += 1
    q.insert(at, (st, b))
    self._charge(st).preemptions += 1

  def _preempt_after_observation(self, b: _Branch, tokens: list[int], last: int) -> None:
    """Preempts `b` at the end of a turn whose observation it has no pages for: it resumes from
    its new node, observation included (the node's K/V is recomputed then)."""
    node = b.node
    b.kv_len += len(tokens)
    b.unwritten = len(tokens)  # prefilled at its resume for the first time: not recomputed
    b.pending = last
    b.parent_node, b.feature_for = node.id, node.id
    b.turn_ids, b.turn_lps, b.turn_ents, b.end_reason = [], [], [], ""
    b.turn_limit = self._turn_limit(b)
    b.rekv = b.rekv + [(node.id, b.kv_len)]
    if b.stale_kv:
      b.state.old_kv.add(node.id)
    b.ending = False
    self._preempt(next(i for i, o in enumerate(self.slots) if o is b))

  # ---- starting a branch whose K/V is not all cached -------------------------------------------
  def _resume_tokens(self, b: _Branch) -> tuple[int, list[int]]:
    """(anchor node, every token of the branch so far: the anchor's path and the turn's tokens)."""
    anchor = b.parent_node  # (a leaf's feature step: the leaf's tokens, not its cut observation)
    ids = [int(t) for t in b.tree.path_tokens(anchor)[0]]
    return anchor, ids + [int(t) for t in (b.node.gen_ids if b.final else b.turn_ids)]

  def _prefill_need(self, st: TreeState, anchor: int, kv_len: int) -> int:
    """Pages a branch of `kv_len` written tokens from `anchor` needs of its own when its K/V is
    prefilled (sharing the anchor's cached full pages)."""
    full = self._shared_full(st, anchor)
    return -(-kv_len // self.cfg.page_size) - full

  def _shared_full(self, st: TreeState, anchor: int) -> int:
    if anchor not in st.kv or not self.cfg.share_prefix:
      return 0
    return st.kv[anchor][1] // self.cfg.page_size

  def _start_prefilled(self, slot: int, b: _Branch, anchor: int, ids: list[int], own: list[int],
                       recompute: bool, turn: tuple = ()) -> None:
    """Puts `b` in `slot` over pages it prefills itself: the anchor's cached full pages shared,
    the rest of its `ids` but the pending last one prefilled into `own` (`turn`: the tokens of
    `ids` after the anchor's path). Nodes it recorded before a preemption (and an anchor with no
    K/V) point at its pages again."""
    cfg, st = self.cfg, b.state
    full = self._shared_full(st, anchor)
    if full and any(j[1] is st.kv[anchor][0] for j in self._jobs):
      self._flush_prefill()  # the shared pages are being written: this prefill attends over them
    shared = list(st.kv[anchor][0][:full]) if full else []
    self.alloc.incref(shared)
    kv_len = len(ids) - 1
    b.pages, b.kv_len, b.pending = shared + own, kv_len, ids[-1]
    b.shared_pages = full
    b.group_key = (st.tree.uid, anchor, shared[0] if shared else own[0] if own else -1)
    b.shard = int(self.slot_shard[slot])
    b.stale_kv = bool(full) and anchor in st.old_kv
    if kv_len > full * cfg.page_size:
      tokens = ids[full * cfg.page_size:kv_len]
      redo = max(0, len(tokens) - b.unwritten) if recompute else 0
      self._jobs.append([b, b.pages, full * cfg.page_size, tokens, None, redo])
    b.unwritten = 0
    for nid, n in b.rekv + ([] if anchor in st.kv else [(anchor, len(ids) - 1 - len(turn))]):
      st.kv[nid] = (b.pages, n)  # (an anchor evicted: its later forks share these pages)
      if b.stale_kv:  # its shared pages hold K/V of replaced weights
        st.old_kv.add(nid)
      else:
        st.old_kv.discard(nid)
    b.rekv = []
    self.slots[slot] = b

  def _resume(self, slot: int, b: _Branch, own: list[int]) -> None:
    anchor, ids = self._resume_tokens(b)
    if len(ids) - 1 != b.kv_len:  # bookkeeping broken: never decode over the wrong K/V
      raise RuntimeError(f"preempted branch of tree {b.tree.uid}: {len(ids) - 1} tokens, "
                         f"{b.kv_len} written")
    turn = b.node.gen_ids if b.final else b.turn_ids
    self._start_prefilled(slot, b, anchor, ids, own, recompute=True, turn=tuple(turn))

  def _cut_waiting(self, st: TreeState, b: _Branch) -> None:
    """Ends a preempted branch the shard cannot take back even alone as a `pool_exhausted` leaf
    (a system cut) after the tokens it had."""
    if not b.final:
      leaf = st.tree.add_node(b.parent_node, gen_ids=b.turn_ids, logprobs=b.turn_lps,
                              entropies=b.turn_ents,
                              text=self.decode(b.turn_ids) if b.turn_ids else "",
                              rollout=b.serial)
      leaf.done, leaf.truncated, leaf.reward = True, "pool_exhausted", self.cfg.truncation_reward
    self._branch_ended(st)


__all__ = ["PreemptionMixin"]
