"""Page bookkeeping of the tree sampler (`sampling.engine`): the per-tree record the engine keeps
(`TreeState`), the host state of a branch in a slot (`_Branch`), and the `SamplerEngine` methods
that hold and drop page references: a tree's lifetime (`tree_state`, `release`, `checkpoint` /
`rollback`), the pages of scored prompts kept for sampling (`drop_kept`), and a branch leaving its
slot (`_retire`, `_unslot`).

Pages are reference-counted by the `PageAllocator` (`sampling.paged_kv`): a branch's pages are
handed to its tree when it leaves its slot and stay alive for forks until `release(trees)`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from trace_jax.sampling.tree import Node, Tree


@dataclasses.dataclass(eq=False)
class TreeState:
  """The engine's bookkeeping of one live tree, kept by the engine (never on the `Tree`) from
  admission until `release`.

  kv: node id -> (page list, KV tokens written) of the prefix ending at that node: what a fork
    from the node shares or copies (the root's entry appears when its first branch starts, and
    again after `update_params` drops it).
  page_refs: the page lists this tree holds one reference each to (every finished branch's, the
    prompt's), freed by `release` or `rollback`.
  branches: branches started so far; the next one's rng stream and `Node.rollout` index.
  outstanding: branches of the current `run` queued or decoding (0 when the tree is idle).
  worker, shard: the (worker, data shard) queue the tree's branches run on (task affinity; its
    pages live in that shard's range); -1 and None until first placed.
  prompt_mean: f32[D] mean final state over the prompt (`prompt_mean_features`), or None.
  ahead: admitted as a rollout of the caller's next step (`run(ahead=...)`) and not yet adopted:
    its work is charged to `engine.ahead_ledger`, and the current run neither waits for it nor
    reports it.
  evicted: ids of nodes whose cached K/V was given back to make room (`engine_preempt`): a fork
    from one prefills its prefix again, counted as recomputed.
  old_kv: ids of the nodes in `kv` whose K/V was written, at least in part, under weights that
    `update_params` has since replaced: a branch forked from one samples its tokens from the new
    weights over the old K/V (neither policy's), and counts them in `meta["stale_tokens"]`.
  """

  tree: Tree
  kv: dict[int, tuple[list[int], int]] = dataclasses.field(default_factory=dict)
  page_refs: list[list[int]] = dataclasses.field(default_factory=list)
  branches: int = 0
  outstanding: int = 0
  worker: int = -1
  shard: int | None = None
  prompt_mean: np.ndarray | None = None
  ahead: bool = False
  old_kv: set[int] = dataclasses.field(default_factory=set)
  evicted: set[int] = dataclasses.field(default_factory=set)


class _Branch:
  """Host state of one active rollout: its page table, lengths, rng and current turn."""

  def __init__(self, state: TreeState, parent_node: int, pages: list[int], kv_len: int,
               pending: int, key: np.ndarray, group_key, shared_pages: int):
    self.state, self.tree = state, state.tree
    self.parent_node, self.pages = parent_node, pages
    self.kv_len, self.pending, self.key = kv_len, pending, key
    self.group_key, self.shared_pages = group_key, shared_pages
    self.counter = 0
    self.turn_ids: list[int] = []
    self.turn_lps: list[float] = []
    self.turn_ents: list[float] = []
    self.feature_for: int | None = None  # node whose feature the next step's hidden state is
    self.final = False                   # the next step only records the leaf feature
    self.waiting = False                 # synchronous turns: turn ended, waiting for the barrier
    self.end_reason = ""
    self.node: Node | None = None
    self.serial = 0                      # rollout index within its tree (Node.rollout)
    self.turn_limit = 0
    self.shard = 0                       # data shard holding the branch's pages and slot
    self.budget = 0                      # decode steps of the next device call
    self.stale_kv = False                # its K/V holds some written under replaced weights
    self.ending = False                  # its turn end is being processed (`_end_turns`)
    self.seq = 0                         # start order in the engine (preemption priority)
    self.rekv: list[tuple[int, int]] = []  # (node, KV length) it recorded, lost when preempted
    self.unwritten = 0                   # its last tokens whose K/V was never written (preempted)


class PageBookkeepingMixin:
  """`SamplerEngine`'s page references: trees from admission to `release`, kept prompts, branches
  leaving their slots. Uses the engine's `cfg`, `alloc`, `shards`, `slots`, `env_step`, `_trees`,
  `_kept`, `_on_trees_done` and `_idle` (set by `SamplerEngine.__init__` and `run`) and
  `drop_carried` (`engine_admission.AdmissionMixin`)."""

  @property
  def live_trees(self) -> dict[int, Tree]:
    """uid -> tree, for every tree admitted and not yet released."""
    return {uid: st.tree for uid, st in self._trees.items()}

  def tree_state(self, tree: Tree) -> TreeState:
    """The engine's bookkeeping of a live `tree` (see `TreeState`); KeyError once released."""
    st = self._trees.get(tree.uid)
    if st is None or st.tree is not tree:
      raise KeyError(f"tree {tree.uid} is not live on this engine (released, or a copy)")
    return st

  def release(self, trees: Sequence[Tree] | None = None) -> None:
    """Drops every page reference held by `trees` (all live trees if None) and the engine's record
    of them, and the environment's per-node state when the env callback keeps one (it has a
    `release(trees)` method). With `trees` None, also the pages of scored prompts kept for
    sampling (`drop_kept`)."""
    if trees is None:
      self.drop_kept()
      self.drop_carried()
    trees = [st.tree for st in self._trees.values()] if trees is None else list(trees)
    for tree in trees:
      st = self._trees.pop(tree.uid, None)
      for pages in st.page_refs if st is not None else ():
        self.alloc.decref(pages)
    env_release = getattr(self.env_step, "release", None)
    if env_release is not None:
      env_release(trees)

  def checkpoint(self, tree: Tree) -> tuple[int, int]:
    """A mark to `rollback` to: the tree's node count and page references now."""
    return len(tree.nodes), len(self.tree_state(tree).page_refs)

  def rollback(self, tree: Tree, mark: tuple[int, int]) -> None:
    """Discards the nodes and KV pages a tree gained after `checkpoint` (e.g. to drop a round of
    continuations); the nodes from before stay forkable. The branch counter runs on (later forks
    draw new rng streams)."""
    st = self.tree_state(tree)
    n_nodes, n_refs = mark
    for pages in st.page_refs[n_refs:]:
      self.alloc.decref(pages)
    del st.page_refs[n_refs:]
    del tree.nodes[n_nodes:]
    for n in tree.nodes:
      n.children = [c for c in n.children if c < n_nodes]
    for k in [k for k in st.kv if k >= n_nodes]:
      del st.kv[k]
    st.old_kv = {k for k in st.old_kv if k < n_nodes}  # ids the next nodes take again
    st.evicted = {k for k in st.evicted if k < n_nodes}

  def check_rollout_fits(self, what: str = "a rollout") -> None:
    """Raises ValueError unless one pool shard holds a rollout of `max_seq_len` tokens and the
    copy of its anchor's partial page: the least a branch needs alone. A tree's pages live on the
    shard it was placed on; a fuller shard evicts cached K/V and preempts branches
    (`engine_preempt`), so only a rollout the shard cannot hold alone could ever be cut."""
    cfg = self.cfg
    need = cfg.max_pages_per_seq + 1
    have = self.alloc.pages_per_shard - 1
    if need > have:
      where = (f"one of the {self.shards} data shards" if self.shards > 1 else "the pool")
      raise ValueError(
          f"{what} of up to {cfg.max_pages_per_seq} pages (max_seq_len {cfg.max_seq_len} / "
          f"page_size {cfg.page_size}) and one page for its anchor's copy needs {need} pages on "
          f"one shard, but {where} holds {have} (num_pages {cfg.num_pages}); raise num_pages to "
          f"at least {(need + 1) * self.shards}"
          + (" or use fewer data shards" if self.shards > 1 else ""))

  def drop_kept(self) -> None:
    """Releases the pages of scored prompts kept for sampling (`prompt_features(keep=True)`)
    that no run has admitted."""
    for pages, _ in self._kept.values():
      self.alloc.decref(pages)
    self._kept.clear()

  @property
  def kept_prompts(self) -> int:
    """Scored prompts whose K/V pages are kept for the sampler (not yet admitted)."""
    return len(self._kept)

  def _unslot(self, which=lambda b: True) -> None:
    """Takes the branches `which` selects out of their slots, their pages handed to their trees
    (freed by `release`)."""
    for i, b in enumerate(self.slots):
      if b is not None and which(b):
        b.state.page_refs.append(b.pages)
        self.slots[i] = None

  def _retire(self, i):
    b = self.slots[i]
    spare = b.pages[-(-b.kv_len // self.cfg.page_size):]  # pages taken ahead, never written
    if spare:
      del b.pages[len(b.pages) - len(spare):]
      self.alloc.decref(spare)
    b.state.page_refs.append(b.pages)  # pages stay alive for forks until release(trees)
    self.slots[i] = None
    self._branch_ended(b.state)

  def _branch_ended(self, st: TreeState) -> None:
    st.outstanding -= 1
    if st.outstanding == 0:
      # Idle: no branch of it runs or waits, so its node ids can move to the canonical order
      # (`Tree.canonicalize`): a tree's ids, and so everything read from them, are then the
      # same whatever the schedule (slots, pool, preemptions).
      moved = st.tree.canonicalize()
      if moved is not None:
        st.kv = {moved[k]: v for k, v in st.kv.items()}
        st.old_kv = {moved[k] for k in st.old_kv}
        st.evicted = {moved[k] for k in st.evicted}
        env_renumber = getattr(self.env_step, "renumber", None)
        if env_renumber is not None:  # an env callback keeping per-node state (it has `release`)
          env_renumber(st.tree, moved)
      if self._on_trees_done is not None and not st.ahead:
        self._idle.append(st.tree)

  def _drop_unwritten(self) -> None:
    """After an aborted run: forgets the K/V records of nodes whose prefill (a prompt's, or an
    observation's after a turn) was queued but never ran, so no later fork reads K/V that was
    never written; those nodes are no longer forkable (their pages stay the tree's until
    `release`). A queued job [owner, pages, start, tokens, ...] has written its K/V up to
    `start`."""
    for job in self._jobs:
      owner, pages, start, tokens = job[:4]
      if owner is None or not tokens:  # scoring jobs: `prompt_features` cleans up its own
        continue
      st = owner.state if isinstance(owner, _Branch) else owner
      for nid, (kv_pages, n) in list(st.kv.items()):
        if kv_pages is pages and n > start:
          del st.kv[nid]
          st.old_kv.discard(nid)

  def _age_kv(self) -> None:
    """New weights (`update_params`): every K/V the pool holds was written under the old ones.
    Live trees forget their prompts' K/V (a branch started from the root later prefills its
    prompt again, under the new weights; the pages stay the tree's until `release`) and mark
    their other recorded nodes `old_kv`; branches in slots continue over old K/V (`stale_kv`)."""
    for st in self._trees.values():
      st.kv.pop(0, None)
      st.old_kv.update(st.kv)
    for b in self.slots:
      if b is not None:
        b.stale_kv = True
