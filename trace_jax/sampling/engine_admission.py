"""Request admission and scheduling of the tree sampler (`sampling.engine`): `SamplerEngine.run`,
the admission of prompts and forks into per-(worker, data shard) queues (`_admit`), the refill of
free slots from those queues (`_refill`: a fork shares its anchor's full pages and copies the
partial last one), and the rollouts started ahead for the caller's next step (`carried`,
`drop_carried`, `ahead_ledger`).

Requests are checked before any is admitted (`_check_requests`), so a refused call changes
nothing. A branch the pool cannot give its first pages (its prompt's, the copy of its anchor's
partial page, or a prefill of K/V given back earlier) makes room by evicting cached K/V
(`engine_preempt`); else it waits in its queue while a branch on its shard decodes, and only
when nothing there could give pages back (pages held outside the engine's trees) ends at once as
a `pool_exhausted` leaf.
"""

from __future__ import annotations

import collections

import numpy as np

from trace_jax.sampling.config import ForkRequest, Ledger, PromptRequest
from trace_jax.sampling.engine_pages import TreeState, _Branch
from trace_jax.sampling.paged_kv import PoolExhaustedError
from trace_jax.sampling.tree import Node, Tree

_COPY_BATCH = 64  # pages copied per copy_pages call


class AdmissionMixin:
  """`SamplerEngine.run` and what feeds its slots. Uses the engine's `cfg`, `alloc`, `shards`,
  `pool`, `slots`, `slot_worker`, `slot_shard`, `ledger`, `ahead_ledger`, `record_steps`,
  `starts`, `_trees`, `_kept`, `_pending`, `_ahead_pending`, `_carried`, `_next_uid`, `_jobs`,
  `_idle`, `_on_trees_done` and `_copy` (set by `SamplerEngine.__init__`), with the loop
  (`engine_loop.DecodeLoopMixin`), page (`engine_pages.PageBookkeepingMixin`) and feature
  (`engine_features.PromptFeaturesMixin`) methods."""

  def run(self, requests, *, num_workers: int = 1, sync_turns: bool = False,
          sync_refill: bool = False, on_trees_done=None, ahead=(), adopt: bool = False
          ) -> list[Tree]:
    """Samples every request to completion and returns the trees, in request order.

    ahead: requests of the caller's *next* step (PromptRequest only). Their branches start only in
    slots this run's own work leaves idle (its tail), and the run returns as soon as its own trees
    are done, leaving them decoding or queued: `carried` lists their trees. The next call must
    adopt them (`adopt=True`: they come first in its result and are sampled to completion with
    the weights it has then; `update_params` in between swaps the weights under them, and their
    tokens sampled over K/V of the old weights count in `meta["stale_tokens"]`) or
    `drop_carried()`. Their cost is kept in `ahead_ledger` until adopted, so each run's `ledger`
    delta is the cost of the trees it returns; so is the prefill of the pool they were scored in
    (`prompt_features`).

    on_trees_done: optional callback(trees) -> requests. Between decode steps it receives the
    trees of this run that went idle since the last call (every rollout started for them has
    finished), in the order they went idle; the requests it returns (forks of live trees, or new
    prompts, whose trees are appended to the result) join the run at once, while the other trees
    are still decoding, and a tree that gets more rollouts is reported again when they finish.
    This is how a second stage streams into the first one's tail instead of waiting for every
    tree.

    requests: PromptRequest, ForkRequest or (tree, anchor node, k) tuples. With num_workers > 1 the
    slots are split into contiguous blocks, each tree belongs to one worker and a worker's slots
    are refilled only from its own trees (task affinity); on a mesh a tree also stays on one data
    shard (its pages' range), a worker's slots on shard d take only its trees of shard d, and a
    fork goes to the shard of its tree. sync_turns: every slot waits for the
    slowest turn before the next one, and new branches start only when all slots are empty (or,
    with sync_refill, at every turn barrier).

    Every request (and `ahead`) is checked before any is admitted: a bad one raises and the engine
    is as it was (carried trees still carried). A prompt a pool shard cannot hold alone is refused
    up front with PoolExhaustedError. A pool that is merely full evicts cached K/V, makes
    branches wait or preempts them (`engine_preempt`), never an error. After an error inside the
    run, every branch's pages go to its tree (`release` frees them) and nodes whose queued
    prefill never ran are no longer forkable.
    """
    s = self.cfg.num_slots
    if not 1 <= num_workers <= s:
      raise ValueError(f"num_workers must be in [1, {s}], got {num_workers}")
    if self._carried and not adopt:
      raise ValueError(f"{len(self._carried)} trees started ahead by the last run are still "
                       f"live: adopt them (run(..., adopt=True)) or drop_carried() first")
    if any(not isinstance(r, PromptRequest) for r in ahead):
      raise ValueError("ahead takes PromptRequests only (the next step's new prompts)")
    slot_worker = (np.arange(s) * num_workers // s).astype(np.int32)
    if adopt and self._carried and not np.array_equal(slot_worker, self.slot_worker):
      raise ValueError("adopting carried trees needs the num_workers they were started with")
    requests, ahead = list(requests), list(ahead)
    self._check_requests(requests + ahead)  # before anything is admitted or adopted
    self.slot_worker = slot_worker
    self._pending = {(int(w), int(d)): collections.deque()
                     for w, d in zip(self.slot_worker, self.slot_shard)}
    self._on_trees_done, self._idle = on_trees_done, []
    carried, self._carried = self._carried, []
    if carried:  # the last run's ahead trees become this run's first ones
      for key, q in self._ahead_pending.items():
        self._pending[key].extend(q)
      for t in carried:
        st = self._trees[t.uid]
        st.ahead = False
        if st.outstanding == 0 and on_trees_done is not None:
          self._idle.append(t)  # done while carried: reported at this run's first step
      self._absorb_ahead_ledger()
    self._ahead_pending = {key: collections.deque() for key in self._pending}
    trees = self._run_trees = list(carried)
    ahead_trees, done = [], False
    try:
      trees += self._admit(requests, num_workers)
      if ahead:
        ahead_trees = self._admit(ahead, num_workers, ahead=True)
        self._bill_scoring_ahead(ahead_trees)
      self.drop_kept()  # the scored prompts this run does not sample: their pages go back now
      self._loop(sync_turns, num_workers, sync_refill)
      done = True
    finally:
      if not done:  # an error: hand every branch's pages to its tree for release
        self._unslot()
        self._drop_unwritten()  # K/V of queued prefills the error dropped: never written
        for st in self._trees.values():
          st.outstanding = 0
        self._ahead_pending, ahead_trees = {}, []
        self._absorb_ahead_ledger()
      self._jobs, self._on_trees_done, self._idle = [], None, []
    self._carried = ahead_trees
    return trees

  @property
  def carried(self) -> list[Tree]:
    """Trees started ahead by the last `run` and not yet adopted by one (`run(adopt=True)`)."""
    return list(self._carried)

  def drop_carried(self) -> None:
    """Stops the rollouts carried ahead and releases their trees; their cost so far moves into
    `ledger` (work done, not used)."""
    uids = {t.uid for t in self._carried}
    self._unslot(lambda b: b.tree.uid in uids)
    self._ahead_pending = {}
    trees, self._carried = self._carried, []
    self.release(trees)
    self._absorb_ahead_ledger()

  def _absorb_ahead_ledger(self) -> None:
    for k, v in self.ahead_ledger.as_dict().items():
      setattr(self.ledger, k, getattr(self.ledger, k) + v)
    self.ahead_ledger = Ledger()

  def _charge(self, st: "TreeState | None") -> Ledger:
    """The ledger a tree's work is charged to (None: not a tree's, e.g. scoring a pool)."""
    return self.ahead_ledger if st is not None and st.ahead else self.ledger

  def _bill_scoring_ahead(self, ahead_trees) -> None:
    """Moves the prefill of the pool the rollouts started ahead were chosen from (the latest
    `prompt_features` call since the last weight update that scored all their prompts) from
    `ledger` to `ahead_ledger`: it is the cost of the step that adopts them, not of this one."""
    keys = {tuple(t.prompt_ids) for t in ahead_trees}
    for i in range(len(self._scored) - 1, -1, -1):
      scored, tokens = self._scored[i]
      if keys <= scored:
        del self._scored[i]
        self.ledger.prefill_tokens -= tokens
        self.ahead_ledger.prefill_tokens += tokens
        return

  # ---- admission ---------------------------------------------------------------------------------
  def _check_requests(self, requests) -> list:
    """The requests as PromptRequest / ForkRequest, each checked as `_admit` would admit it
    (prompt length, uid free, anchor forkable, counts >= 0) before any is, and each new prompt's
    pages against a pool shard (a prompt a shard cannot hold alone could never be sampled).
    Raises ValueError (PoolExhaustedError for the pages)."""
    cfg, out, uids, next_uid = self.cfg, [], set(), self._next_uid
    pages = []
    for req in requests:
      if isinstance(req, tuple):
        req = ForkRequest(*req)
      if isinstance(req, PromptRequest):
        n = len(req.prompt_ids)
        if not 1 <= n < cfg.max_seq_len:
          raise ValueError(f"prompt length {n} not in [1, max_seq_len={cfg.max_seq_len})")
        if int(req.n) < 0:
          raise ValueError(f"PromptRequest.n must be >= 0, got {req.n}")
        uid = next_uid if req.uid is None else int(req.uid)
        if uid in self._trees:  # its record (pages, rng streams) would be another tree's
          raise ValueError(f"tree uid {uid} is still live on this engine; release that tree "
                           f"before reusing its uid")
        if uid in uids:
          raise ValueError(f"tree uid {uid} is requested twice in one call")
        uids.add(uid)
        next_uid += int(req.uid is None)
        if int(req.n) > 0:  # (a prompt sampled 0 times takes no page)
          pages.append(-(-(n - 1) // cfg.page_size))
      elif isinstance(req, ForkRequest):
        tree, node_id = req.tree, req.node
        node_id = node_id.id if isinstance(node_id, Node) else int(node_id)
        if not 0 <= node_id < len(tree.nodes):
          raise IndexError(f"node {node_id} not in tree {tree.uid}")
        if tree.nodes[node_id].done:
          raise ValueError(f"cannot fork from node {node_id} of tree {tree.uid}: it is a finished "
                           f"leaf (truncated={tree.nodes[node_id].truncated!r}); fork from an "
                           f"anchor")
        st = self._trees.get(tree.uid)
        if st is None or (node_id not in st.kv and node_id != 0 and node_id not in st.evicted):
          raise ValueError(f"cannot fork from node {node_id} of tree {tree.uid}: it has no K/V "
                           f"(its pages were released: fork before calling engine.release; or "
                           f"a run stopped by an error before its observation was prefilled)")
        if st.tree is not tree:  # the forks would grow a tree the KV map does not describe
          raise ValueError(f"cannot fork from tree {tree.uid}: it is a copy, not the tree this "
                           f"engine sampled under that uid")
        if int(req.k) < 0:
          raise ValueError(f"ForkRequest.k must be >= 0, got {req.k}")
        req = ForkRequest(tree, node_id, int(req.k))
      else:
        raise TypeError(f"not a sampling request: {req!r}")
      out.append(req)
    per_shard = self.alloc.pages_per_shard - 1
    if pages and max(pages) + 1 > per_shard:
      raise PoolExhaustedError(
          f"KV pool exhausted: a prompt of this call needs {max(pages)} pages and its first "
          f"branch one more, but a data shard holds {per_shard} (num_pages {cfg.num_pages}); "
          f"raise SamplerConfig.num_pages")
    return out

  def _admit(self, requests, num_workers, ahead: bool = False) -> list[Tree]:
    queues = self._ahead_pending if ahead else self._pending
    trees, load = [], {c: 0 for c in queues}
    for req in self._check_requests(requests):  # all checked before the first is admitted
      if isinstance(req, PromptRequest):
        ids = [int(t) for t in req.prompt_ids]
        uid = self._next_uid if req.uid is None else int(req.uid)
        if req.uid is None:
          self._next_uid += 1
        tree = Tree(ids, uid=uid, meta=req.meta, prompt_text=req.prompt_text)
        st = self._trees[uid] = TreeState(tree, ahead=ahead)
        node_id, count = 0, int(req.n)
        kept = self._kept.get(tuple(ids))
        if kept is not None:  # scored with keep: its K/V is in these pages already
          shard = self.alloc.shard_of(kept[0][0])
          # On a mesh the pages fix the tree's shard; a shard already fuller than the emptiest
          # by more than this tree prefills it afresh there instead (balance over one prefill).
          if min(v for c, v in load.items() if c[1] == shard) - min(load.values()) <= count:
            del self._kept[tuple(ids)]
            st.kv[0] = kept
            st.page_refs.append(kept[0])
            st.shard = shard
      else:
        tree, node_id, count = req.tree, req.node, req.k
        st = self._trees[tree.uid]
      # (worker, shard) queues: a tree keeps its shard (its pages live there) and, when it can,
      # its worker; otherwise the least loaded queue takes it.
      cands = [c for c in load if st.shard is None or c[1] == st.shard]
      prefer = [c for c in cands if c[0] == st.worker]
      pick = min(prefer or cands, key=lambda c: load[c])
      st.worker, st.shard = pick
      load[pick] += count
      queues[pick].extend([(st, node_id)] * count)
      st.outstanding += count
      if all(t is not tree for t in trees):
        trees.append(tree)
    if self.cfg.prompt_mean_features:
      states = [self._trees[t.uid] for t in trees]
      self._set_prompt_means([st for st in states if st.prompt_mean is None])
    return trees

  # ---- slot refill -------------------------------------------------------------------------------
  def _own_work_left(self) -> bool:
    """Whether this run's own trees (not those started ahead) have branches queued or running."""
    return (any(self._pending.values()) or
            any(b is not None and not b.state.ahead for b in self.slots))

  def _refill(self):
    """Starts queued branches (and resumes preempted ones) in the free slots. One whose pages the
    shard cannot give, even after evicting cached K/V (`engine_preempt`), stays at the head of
    its queue while a branch on its shard is in a slot, and else is cut as a `pool_exhausted`
    leaf: the shard cannot hold it alone (pages held outside the engine's trees)."""
    started = False
    while True:
      blocked = {}  # queue id -> (queue, shard) of queues whose head cannot get its pages
      for i, b in enumerate(self.slots):
        key = (int(self.slot_worker[i]), int(self.slot_shard[i]))
        q = self._pending[key]
        if b is None and not q and self._ahead_pending:
          q = self._ahead_pending[key]  # an idle slot: the next step's rollouts may start here
        if b is not None or not q or id(q) in blocked:
          continue
        st, what = q[0]
        if not self._start(i, st, what):
          blocked[id(q)] = (q, key[1])
          continue
        q.popleft()
        started = True
      busy = {int(self.slot_shard[i]) for i, b in enumerate(self.slots) if b is not None}
      stuck = [q for q, shard in blocked.values() if shard not in busy]
      if not stuck:  # the others wait for the pages a decoding branch gives back as it retires
        break
      for q in stuck:  # nothing on its shard will give pages back: end it now
        st, what = q.popleft()
        if isinstance(what, _Branch):
          self._cut_waiting(st, what)
        else:
          self._cut_start(st, what)
    if started:
      self._flush_prefill()  # the anchors' K/V must exist before their partial pages are copied
      self._flush_copies()

  def _flush_copies(self) -> None:
    """Copies the anchors' partial pages queued by `_start` into their forks' own pages."""
    src, dst = self._copies
    for j in range(0, max(map(len, src)), _COPY_BATCH):  # fixed batch: one compilation
      s_ids, d_ids = [], []
      for shard in range(self.shards):  # block per shard, padded with the shard's null page
        s, d = src[shard][j:j + _COPY_BATCH], dst[shard][j:j + _COPY_BATCH]
        pad = [self.alloc.null_page(shard)] * (_COPY_BATCH - len(s))
        s_ids += s + pad
        d_ids += d + pad
      self.pool = self._copy(self.pool, np.asarray(s_ids, np.int32), np.asarray(d_ids, np.int32))
    self._copies = ([[] for _ in range(self.shards)], [[] for _ in range(self.shards)])

  def _start_need(self, st: TreeState, what) -> int:
    """Pages a branch (a new one from node `what`, or a preempted `_Branch`) takes to start."""
    ps = self.cfg.page_size
    if isinstance(what, _Branch):
      anchor, ids = self._resume_tokens(what)
      return self._prefill_need(st, anchor, len(ids) - 1)
    if what in st.kv:  # a fork: the copy of the anchor's partial last page (all, unshared)
      kv_len = st.kv[what][1]
      return -(-kv_len // ps) - (kv_len // ps if self.cfg.share_prefix else 0)
    if what == 0 and 0 not in st.evicted:  # the prompt's pages (the tree's), then a fork
      n = len(st.tree.prompt_ids) - 1
      return 2 * -(-n // ps) - (n // ps if self.cfg.share_prefix else 0)
    return self._prefill_need(st, what, st.tree.prefix_len(what) - 1)  # evicted: prefill it

  def _start(self, slot: int, st: TreeState, what) -> bool:
    """Starts (or resumes) a branch in `slot` when its shard has, or can be given, its pages;
    False otherwise. A new one from a cached anchor shares its full pages and copies its partial
    last one; from a root never prefilled, prefills the prompt into the tree's pages first; from
    an evicted node, prefills the node's prefix into its own pages."""
    shard = int(self.slot_shard[slot])
    for protect in (st, None, None):  # the tree's own cache goes last
      if self._make_room(shard, self._start_need(st, what), protect=protect):
        break
    need = self._start_need(st, what)
    if self.alloc.num_free_in(shard) < need:
      return False
    if isinstance(what, _Branch):
      self._resume(slot, what, self.alloc.alloc(need, shard))
      return True
    node_id, cfg = what, self.cfg
    if node_id not in st.kv and (node_id != 0 or 0 in st.evicted):
      b = self._new_branch(slot, st, node_id)
      ids = [int(t) for t in st.tree.path_tokens(node_id)[0]]
      self._start_prefilled(slot, b, node_id, ids, self.alloc.alloc(need, shard), recompute=True)
      return True
    if node_id not in st.kv:  # the prompt's K/V must exist before it is forked
      prompt = st.tree.prompt_ids
      n = len(prompt) - 1
      pages = self.alloc.alloc(-(-n // cfg.page_size), shard)
      st.page_refs.append(pages)
      st.kv[0] = (pages, n)
      self._jobs.append([st, pages, 0, list(prompt[:-1]), None])
    pages, kv_len = st.kv[node_id]
    # Share the anchor's full pages (never written again); copy the partial last one. Without
    # sharing (an ablation), every page is copied.
    full = kv_len // cfg.page_size if cfg.share_prefix else 0
    used = -(-kv_len // cfg.page_size)
    own = self.alloc.alloc(used - full, shard)
    shared = list(pages[:full])
    self._copies[0][shard] += pages[full:used]
    self._copies[1][shard] += own
    self.alloc.incref(shared)
    b = self._new_branch(slot, st, node_id)
    # The group key names the anchor's K/V itself (its first page): after new weights a root's
    # prompt is prefilled again into other pages, and its old and new branches share nothing.
    b.pages, b.kv_len, b.shared_pages = shared + own, kv_len, full
    b.group_key = (st.tree.uid, node_id, pages[0] if pages else -1)
    b.stale_kv = node_id in st.old_kv
    self.slots[slot] = b
    return True

  def _new_branch(self, slot: int, st: TreeState, node_id: int) -> _Branch:
    """A new branch of `st` from `node_id` (its rng stream, rollout index, turn limit), without
    pages yet; counted as a rollout started."""
    cfg, tree = self.cfg, st.tree
    node = tree.nodes[node_id]
    serial = st.branches
    st.branches += 1
    seq = np.random.SeedSequence([cfg.seed, tree.uid, serial])
    b = _Branch(st, node_id, [], 0, (node.gen_ids + node.obs_ids)[-1],
                seq.generate_state(2, np.uint32), None, 0)
    b.serial, b.shard = serial, int(self.slot_shard[slot])
    b.seq, self._start_seq = self._start_seq, self._start_seq + 1
    b.feature_for = node_id if node.feature is None else None
    b.turn_limit = self._turn_limit(b)
    if self.record_steps:
      self.starts.append((slot, tree.uid))
    self._charge(st).rollouts_started += 1
    return b

  def _cut_start(self, st: TreeState, node_id: int) -> None:
    """Ends a branch the pool could not start as an empty `pool_exhausted` leaf under `node_id`
    (a system cut: the training loop leaves it out); it counts as a rollout started."""
    serial = st.branches
    st.branches += 1
    leaf = st.tree.add_node(node_id, rollout=serial)
    leaf.done, leaf.truncated, leaf.reward = True, "pool_exhausted", self.cfg.truncation_reward
    self._charge(st).rollouts_started += 1
    self._branch_ended(st)
