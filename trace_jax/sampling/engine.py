"""Continuous-batching tree sampler over a paged KV pool.

A fixed number of decode slots each hold one active branch (a rollout in progress). Every host
iteration: free slots are refilled from pending branches (new prompts or forks), queued prefills
(prompts, observations) run in fixed chunk buckets, then one jitted decode call advances every busy
slot by up to `decode_steps` tokens (a device loop; a slot stops on the device at EOS, at the token
ids of a stop string or at its turn or length limit, so the host acts once per turn end or per
`decode_steps` tokens). A turn ends on a stop string, EOS or a length limit; the environment
callback runs, batched over the slots whose turns ended, and its observation is prefilled into the
slot's pages before the next turn. Branches forked from one anchor share the anchor's full KV
pages (the tree attention kernel reads them once for all siblings); each copies only the anchor's
last partial page. Every page a tree's nodes use stays alive until `release(trees)`, so the trainer
can fork new branches from any anchor of a finished stage-1 tree. The engine keeps that
bookkeeping itself, by tree uid (`tree_state`); a `Tree` is plain data.

On a mesh (`mesh=`), the pool's pages split into one contiguous range per data shard, each with
its own allocator range, block of slots and trees; KV heads split over `tensor`; everything that
indexes the pool runs per shard under `shard_map`, so no step gathers the pool.

Shapes are static (slots, pool, prefill and page-table buckets), so after warm-up no step compiles.
Token convention: the last token of a branch is *pending* (its K/V not yet written); the next
decode step writes it and samples from its logits, so that step's hidden state is the predictor
feature of the prefix ending at that token.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from trace_jax.models.predictor import feature_width
from trace_jax.parallel.sharding import DEFAULT_RULES, state_shardings, variable_value
from trace_jax.sampling import engine_ops, slot_tables
from trace_jax.sampling.paged_kv import (PageAllocator, PoolExhaustedError, PoolLayout, tree_pages,
                                        init_pool, make_copy_pages)
from trace_jax.sampling.config import (DEFAULT_STOP_STRINGS, EnvStep, ForkRequest, Ledger,
                                              PromptRequest, SamplerConfig, TurnRef)
from trace_jax.sampling.observation import fit_observation_ids
from trace_jax.sampling.tree import Node, Tree

_COPY_BATCH = 64  # pages copied per copy_pages call


@dataclasses.dataclass(eq=False)
class TreeState:
  """The engine's bookkeeping of one live tree, kept by the engine (never on the `Tree`) from
  admission until `release`.

  kv: node id -> (page list, KV tokens written) of the prefix ending at that node: what a fork
    from the node shares or copies (the root's entry appears when its first branch starts).
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


def sampling_shardings(state, layout: PoolLayout):
  """The sampler's weight layout on `layout.mesh`: the logical rules with `embed` unsplit (decode
  never gathers weights) and the batch over the pool's data axes; NamedShardings shaped like the
  nnx State `state`."""
  rules = tuple((k, None if k == "embed" else (layout.data_axes if k == "batch" else v))
                for k, v in DEFAULT_RULES)
  return state_shardings(state, layout.mesh, rules)


_PROMPT_MEANS_KEPT = 4096  # prompt means cached between weight updates


class SamplerEngine:
  """See the module docstring. `run(requests) -> list[Tree]`; `release(trees)` frees their pages.

  Args:
    model_graphdef, params_state: `nnx.split(Qwen3(...))`; `update_params` swaps the weights.
    cfg: `SamplerConfig` (slots, KV pool, limits, sampling settings).
    encode: str -> list[int]; decode: list[int] -> str (turn text, matched against stop strings).
    env_step: [(TurnRef, generated_text)] -> [(observation_text | None, done, reward)], called
      batched over the slots whose turn ended.
    eos_id: end-of-sequence token id, or None.
    stop_strings: turn-ending strings (default `</search>`, `</answer>`). Their token ids
      (`encode`) also stop a slot on the device, inside a multi-step call; the host's text check
      stays the rule (a stop the ids missed ends the turn at the same token).
    observation_close: the string that closes an observation in the caller's turn protocol (e.g.
      `</information>` for the ReAct environments). An observation cut to fit `max_obs_tokens` or
      the room left keeps its text from the last such marker on as its last tokens, so the policy
      never continues inside an observation it was not shown the end of; "" (default): a plain
      prefix cut.
    record_steps: instrumentation for the scheduler benchmark (`sampling.scheduler`), off (0) by
      default: with N > 0, `step_log` keeps the busy slots per worker of the last N decode steps
      (i32[num_workers] each) and `starts` the (slot, tree uid) of the last N branch starts.
    mesh: a `jax.sharding.Mesh` with axes among (data, fsdp, tensor), or None (one device). On a
      mesh the KV pool's pages split into one contiguous range per data shard (every axis but
      `tensor`), each with its own allocator range, its own block of slots and its own trees;
      KV heads split over `tensor`; the sampling weights are laid out tensor-parallel and
      replicated over the data shards at every `update_params`. Needs num_slots and num_pages
      divisible by the number of data shards.

  `run` returns one `Tree` per request (`trace_jax.sampling.tree`: nodes with generated ids,
  log-probs, observation ids, prefix features f32[D] and leaf rewards); `engine.ledger` counts
  rollouts, generated and prefill tokens and tool calls. The engine's bookkeeping of a tree (KV
  pages, placement, branch counter: `tree_state(tree)`) lives in the engine, keyed by tree uid,
  until `release(trees)`; a tree itself is plain data.

  Example:
    >>> gd, st = nnx.split(Qwen3(get_preset("tiny", vocab_size=32, num_layers=1), rngs=nnx.Rngs(0)))
    >>> cfg = SamplerConfig(num_slots=2, page_size=4, num_pages=64, max_seq_len=32,
    ...                     max_turn_tokens=4, prefill_chunk=(8,), page_buckets=(8,))
    >>> engine = SamplerEngine(gd, st, cfg, encode=lambda s: [], decode=lambda ids: str(ids),
    ...                        env_step=lambda calls: [(None, True, 1.0)] * len(calls), eos_id=None)
    >>> tree, = engine.run([PromptRequest([3, 4, 5], n=2)])  # two rollouts of one prompt
    >>> [len(leaf.gen_ids) for leaf in tree.leaves()], [leaf.reward for leaf in tree.leaves()]
    ([4, 4], [1.0, 1.0])
  """

  def __init__(self, model_graphdef, params_state, cfg: SamplerConfig, encode, decode,
               env_step: EnvStep, eos_id: int | None, stop_strings=DEFAULT_STOP_STRINGS,
               kv_dtype=None, turn_limit_fn=None, mesh=None, observation_close: str = "",
               record_steps: int = 0):
    self.cfg, self.graphdef, self.state = cfg, model_graphdef, params_state
    self.encode, self.decode, self.env_step = encode, decode, env_step
    self.observation_close = observation_close
    self.eos_id, self.stop_strings = eos_id, tuple(stop_strings)
    # Optional (tree, rollout serial, turn depth) -> token limit of that turn, capped by
    # max_turn_tokens; simulated workloads use it to draw turn lengths.
    self.turn_limit_fn = turn_limit_fn
    mcfg = nnx.merge(model_graphdef, params_state).cfg
    self.model_cfg = mcfg
    self.mesh = mesh
    self.layout = (PoolLayout.for_mesh(mesh, mcfg.num_kv_heads)
                   if mesh is not None and mesh.size > 1 else None)
    self.shards = self.layout.shards if self.layout is not None else 1
    if cfg.num_slots % self.shards or cfg.num_pages % self.shards:
      raise ValueError(f"num_slots {cfg.num_slots} and num_pages {cfg.num_pages} must split over "
                       f"{self.shards} data shards")
    if cfg.decode_steps < 1:
      raise ValueError(f"decode_steps must be >= 1, got {cfg.decode_steps}")
    self.alloc = PageAllocator(cfg.num_pages, self.shards)
    self.pool = init_pool(mcfg.num_layers, cfg.num_pages, cfg.page_size, mcfg.num_kv_heads,
                          mcfg.head_dim, kv_dtype or mcfg.dtype, layout=self.layout)
    self.buckets = slot_tables.page_buckets(cfg.max_pages_per_seq, cfg.page_buckets)
    self.chunks = tuple(sorted(cfg.prefill_chunk))
    self.groups_per_shard = -(-cfg.num_groups // self.shards)
    self.prefill_rows = -(-cfg.prefill_batch // self.shards)  # prefill rows per shard
    self._param_shardings = None
    self.state = self._place(params_state)
    stop_seqs = []
    for x in self.stop_strings:
      try:
        stop_seqs.append(tuple(int(t) for t in encode(x)))
      except Exception:  # noqa: BLE001  (a tokenizer that cannot encode a tag: host check only)
        pass
    self.stop_width = engine_ops.stop_sequence_table(stop_seqs).shape[1]
    # Static filter switches: no vocabulary sort unless top-p/top-k is on (see sample_tokens).
    self._decode = engine_ops.make_decode_step(
        model_graphdef, cfg.attention_impl, max(cfg.top_k, 0), cfg.top_p < 1.0, self.layout,
        cfg.decode_steps, tuple(stop_seqs), eos_id)
    # One prefill for everything (sampling, observations, scoring a pool with keep): it also
    # returns each row's final states, read only when a scoring job asks, so scoring compiles
    # nothing that sampling does not.
    self._prefill = engine_ops.make_prefill_step(model_graphdef, self.layout)
    self._copy = make_copy_pages(self.layout)
    self._features = engine_ops.make_feature_step(model_graphdef, self.layout,
                                                  cfg.prompt_mean_features)
    self.slots: list[_Branch | None] = [None] * cfg.num_slots
    self.ledger = Ledger()
    # The cost (rollouts, tokens, prefill, tool calls) of rollouts started ahead for the caller's
    # next step: moved into `ledger` when a run adopts them, so each step's ledger is its own
    # trees' cost. (Slot and decode-step counts stay in `ledger`: they are the run's time.)
    self.ahead_ledger = Ledger()
    self._carried: list[Tree] = []  # ahead trees, in admission order, until adopted
    self._ahead_pending: dict = {}  # (worker, shard) -> deque of their branches not started
    # prompt -> mean final state over it, under the current weights (prompt_mean_features): the
    # pool scoring computes it for every candidate, so admitting a scored prompt costs nothing.
    self._prompt_means: dict[tuple, np.ndarray] = {}
    # prompt -> (pages, kv_len) of prompts scored with `prompt_features(keep=True)` and not yet
    # admitted: their K/V, kept for the sampler so no prompt is prefilled twice in a step. Dropped
    # when new weights arrive and when a run has admitted its own (a prompt scored again: replaced).
    self._kept: dict[tuple, tuple[list[int], int]] = {}
    # Bounded and off by default: a training run makes millions of decode steps and never reads
    # them (see record_steps).
    self.record_steps = max(0, int(record_steps))
    self.step_log: collections.deque = collections.deque(maxlen=self.record_steps)
    self.starts: collections.deque = collections.deque(maxlen=self.record_steps)
    self._trees: dict[int, TreeState] = {}  # tree uid -> bookkeeping, admission to release
    self._next_uid = 0
    self._jobs: list = []
    self._on_trees_done, self._idle = None, []  # `run`'s callback and the trees it has to hear of
    self._pending: dict[int, collections.deque] = {}
    self.slot_worker = np.zeros(cfg.num_slots, np.int32)
    self.slot_shard = (np.arange(cfg.num_slots) * self.shards // cfg.num_slots).astype(np.int32)

  # ---- public API --------------------------------------------------------------------------------
  def update_params(self, params_state) -> None:
    """Swaps the sampling weights. Rollouts carried ahead (`run(ahead=...)`) continue under the
    new weights from their K/V as it is; each carried tree records in `meta["stale_tokens"]` the
    tokens it had generated under the old weights (their log-probs are the old policy's, which is
    what the update's ratio is taken against)."""
    self.state = self._place(params_state)
    self._prompt_means.clear()  # computed under the old weights
    self.drop_kept()
    if self._carried:
      stale = {t.uid: sum(len(n.gen_ids) for n in t.nodes) for t in self._carried}
      for b in self.slots:
        if b is not None and b.tree.uid in stale:
          stale[b.tree.uid] += len(b.turn_ids)
      for t in self._carried:
        t.meta["stale_tokens"] = stale[t.uid]

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

  def _unslot(self, which=lambda b: True) -> None:
    """Takes the branches `which` selects out of their slots, their pages handed to their trees
    (freed by `release`)."""
    for i, b in enumerate(self.slots):
      if b is not None and which(b):
        b.state.page_refs.append(b.pages)
        self.slots[i] = None

  def _absorb_ahead_ledger(self) -> None:
    for k, v in self.ahead_ledger.as_dict().items():
      setattr(self.ledger, k, getattr(self.ledger, k) + v)
    self.ahead_ledger = Ledger()

  def _charge(self, st: "TreeState | None") -> Ledger:
    """The ledger a tree's work is charged to (None: not a tree's, e.g. scoring a pool)."""
    return self.ahead_ledger if st is not None and st.ahead else self.ledger

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

  set_params = update_params

  def _place(self, state):
    """On a mesh: the sampling layout of the weights, tensor-parallel (the logical rules with
    `embed` unsplit) and replicated over the data shards; done once per weight update, so decode
    never gathers weights. Without a mesh: as given."""
    if self.layout is None:
      return state
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    leaves = jax.tree.leaves(state, is_leaf=is_var)
    if any(is_var(x) for x in leaves):
      shardings = sampling_shardings(state, self.layout)
      self._param_shardings = jax.tree.leaves(shardings)
      return jax.tree.map(lambda v, sh: v.replace(jax.device_put(variable_value(v), sh)), state,
                          shardings, is_leaf=is_var)
    # Plain arrays (no logical axes): the layout of the weights this engine was built with.
    if self._param_shardings is None or len(self._param_shardings) != len(leaves):
      raise ValueError("weights without logical axes need the engine's first weights' structure")
    flat, tree = jax.tree.flatten(state)
    return jax.tree.unflatten(tree, [jax.device_put(x, sh)
                                     for x, sh in zip(flat, self._param_shardings)])

  def set_uid_base(self, uid: int) -> None:
    """Numbers the next trees from `uid`. Branch rng streams derive from (seed, tree uid, branch),
    so a loop that sets a base per RL step makes each step's sampling a function of its step alone
    (exact resume), whatever ran on the engine before (evaluation, probes)."""
    self._next_uid = int(uid)

  def compile_counts(self) -> dict:
    """Compiled variants per jitted step (-1 where this jax version does not say)."""
    fns = {"decode": self._decode, "prefill": self._prefill, "copy": self._copy,
           "features": self._features}
    return {k: getattr(f, "_cache_size", lambda: -1)() for k, f in fns.items()}

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
    scored the plain way. The features agree with the plain way's to float rounding."""
    if keep:
      if not count_prefill:
        raise ValueError("keep=True prefills for sampling; its tokens count as prefill")
      return self._score_and_keep(prompts)
    return self._plain_features(prompts, count_prefill)

  def _score_and_keep(self, prompts) -> np.ndarray:
    cfg = self.cfg
    keys = [tuple(int(t) for t in p) for p in prompts]
    for key in set(keys) & set(self._kept):  # scored again: the older pages go back
      self.alloc.decref(self._kept.pop(key)[0])
    jobs, plain = {}, []
    for i, key in enumerate(dict.fromkeys(keys)):
      if not 1 <= len(key) < cfg.max_seq_len:
        raise ValueError(f"prompt length {len(key)} not in [1, max_seq_len={cfg.max_seq_len})")
      try:
        pages = self.alloc.alloc(-(-len(key) // cfg.page_size), i % self.shards)
      except PoolExhaustedError:
        plain.append(key)
        continue
      # [branch, pages, start, tokens, features]: the whole prompt, its last token included (the
      # first decode step writes that token's K/V again, identically), for its final state.
      jobs[key] = [None, pages, 0, list(key), {"last": None, "sum": 0.0}]
    self._jobs.extend(jobs.values())
    self._flush_prefill()
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
    if missing:
      self.prompt_features(missing)
    for st in states:
      st.prompt_mean = np.asarray(self._prompt_means[tuple(st.tree.prompt_ids)], np.float32)
    if len(self._prompt_means) > _PROMPT_MEANS_KEPT:  # scored pools of past calls
      self._prompt_means.clear()

  def check_tree_fits(self, branches: int, what: str = "a tree") -> None:
    """Raises ValueError unless one pool shard holds `branches` rollouts of `max_seq_len` tokens
    each (the worst case of one tree, no prefix shared): a tree's pages all live on the data shard
    it was placed on, so a tree larger than a shard's page range cannot be sampled. Callers pass
    the largest tree they will request (e.g. the train loop: stage 1's per-prompt cap, the probe's
    8 samples). Stage-2 continuations fork from pages the tree already holds and are not counted:
    one that finds its shard full ends its turn as `pool_exhausted`."""
    cfg = self.cfg
    need, have = tree_pages(branches, cfg.max_seq_len, cfg.page_size, cfg.num_pages, self.shards)
    if need > have:
      where = (f"one of the {self.shards} data shards" if self.shards > 1 else "the pool")
      raise ValueError(
          f"{what} of {branches} rollouts x {cfg.max_pages_per_seq} pages (max_seq_len "
          f"{cfg.max_seq_len} / page_size {cfg.page_size}) needs {need} pages on one shard, but "
          f"{where} holds {have} (num_pages {cfg.num_pages}); raise num_pages to at least "
          f"{(need + 1) * self.shards}" + (" or use fewer data shards" if self.shards > 1 else ""))

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

  def run(self, requests, *, num_workers: int = 1, sync_turns: bool = False,
          sync_refill: bool = False, on_trees_done=None, ahead=(), adopt: bool = False
          ) -> list[Tree]:
    """Samples every request to completion and returns the trees, in request order.

    ahead: requests of the caller's *next* step (PromptRequest only). Their branches start only in
    slots this run's own work leaves idle (its tail), and the run returns as soon as its own trees
    are done, leaving them decoding or queued: `carried` lists their trees. The next call must
    adopt them (`adopt=True`: they come first in its result and are sampled to completion with
    the weights it has then; `update_params` in between swaps the weights under them) or
    `drop_carried()`. Their cost is kept in `ahead_ledger` until adopted, so each run's `ledger`
    delta is the cost of the trees it returns.

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
    trees = self._run_trees = carried + self._admit(requests, num_workers)
    ahead_trees = self._admit(list(ahead), num_workers, ahead=True) if ahead else []
    self.drop_kept()  # the scored prompts this run does not sample: their pages go back now
    done = False
    try:
      self._loop(sync_turns, num_workers, sync_refill)
      done = True
    finally:
      if not done:  # an error: hand every branch's pages to its tree for release
        self._unslot()
        for st in self._trees.values():
          st.outstanding = 0
        self._ahead_pending, ahead_trees = {}, []
        self._absorb_ahead_ledger()
      self._jobs, self._on_trees_done, self._idle = [], None, []
    self._carried = ahead_trees
    return trees

  # ---- admission ---------------------------------------------------------------------------------
  def _admit(self, requests, num_workers, ahead: bool = False) -> list[Tree]:
    queues = self._ahead_pending if ahead else self._pending
    trees, load = [], {c: 0 for c in queues}
    for req in requests:
      if isinstance(req, tuple):
        req = ForkRequest(*req)
      if isinstance(req, PromptRequest):
        ids = [int(t) for t in req.prompt_ids]
        if not 1 <= len(ids) < self.cfg.max_seq_len:
          raise ValueError(
              f"prompt length {len(ids)} not in [1, max_seq_len={self.cfg.max_seq_len})")
        uid = self._next_uid if req.uid is None else int(req.uid)
        if uid in self._trees:  # its record (pages, rng streams) would be another tree's
          raise ValueError(f"tree uid {uid} is still live on this engine; release that tree "
                           f"before reusing its uid")
        if req.uid is None:
          self._next_uid += 1
        tree = Tree(ids, uid=uid, meta=req.meta, prompt_text=req.prompt_text)
        st = self._trees[uid] = TreeState(tree, ahead=ahead)
        node_id, count = 0, req.n
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
        node_id = node_id.id if isinstance(node_id, Node) else int(node_id)
        if not 0 <= node_id < len(tree.nodes):
          raise IndexError(f"node {node_id} not in tree {tree.uid}")
        if tree.nodes[node_id].done:
          raise ValueError(f"cannot fork from node {node_id} of tree {tree.uid}: it is a finished "
                           f"leaf (truncated={tree.nodes[node_id].truncated!r}); fork from an "
                           f"anchor")
        st = self._trees.get(tree.uid)
        if st is None or (node_id not in st.kv and node_id != 0):
          raise ValueError(f"cannot fork from node {node_id} of tree {tree.uid}: its KV pages were "
                           f"released (fork before calling engine.release)")
        if st.tree is not tree:  # the forks would grow a tree the KV map does not describe
          raise ValueError(f"cannot fork from tree {tree.uid}: it is a copy, not the tree this "
                           f"engine sampled under that uid")
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

  # ---- main loop ---------------------------------------------------------------------------------
  def _own_work_left(self) -> bool:
    """Whether this run's own trees (not those started ahead) have branches queued or running."""
    return (any(self._pending.values()) or
            any(b is not None and not b.state.ahead for b in self.slots))

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
        if any(self._pending.values()):
          raise RuntimeError("pending branches but no slot could start one")  # not reachable
        return
      decoding = self._ensure_pages(decoding)
      if decoding:
        self._step(decoding, num_workers, sync_turns)

  def _refill(self):
    starts = []
    for i, b in enumerate(self.slots):
      key = (int(self.slot_worker[i]), int(self.slot_shard[i]))
      q = self._pending[key]
      if b is None and not q and self._ahead_pending:
        q = self._ahead_pending[key]  # an idle slot: the next step's rollouts may start here
      if b is None and q:
        starts.append((i, *q.popleft()))
    if not starts:
      return
    cfg = self.cfg
    for _, st, node_id in starts:  # the prompt's K/V must exist before it is forked
      if node_id == 0 and 0 not in st.kv:
        prompt = st.tree.prompt_ids
        n = len(prompt) - 1
        pages = self.alloc.alloc(-(-n // cfg.page_size), st.shard)
        st.page_refs.append(pages)
        st.kv[0] = (pages, n)
        self._jobs.append([st, pages, 0, list(prompt[:-1]), None])
    self._flush_prefill()
    src, dst = [[] for _ in range(self.shards)], [[] for _ in range(self.shards)]
    for slot, st, node_id in starts:
      tree = st.tree
      pages, kv_len = st.kv[node_id]
      # Share the anchor's full pages (never written again); copy the partial last one. Without
      # sharing (an ablation), every page is copied.
      full = kv_len // cfg.page_size if cfg.share_prefix else 0
      used = -(-kv_len // cfg.page_size)
      shared = list(pages[:full])
      shard = int(self.slot_shard[slot])
      own = self.alloc.alloc(used - full, shard)  # may raise PoolExhaustedError (run() cleans up)
      src[shard] += pages[full:used]
      dst[shard] += own
      self.alloc.incref(shared)
      node = tree.nodes[node_id]
      serial = st.branches
      st.branches += 1
      seq = np.random.SeedSequence([cfg.seed, tree.uid, serial])
      b = _Branch(st, node_id, shared + own, kv_len, (node.gen_ids + node.obs_ids)[-1],
                  seq.generate_state(2, np.uint32), (tree.uid, node_id), full)
      b.serial, b.shard = serial, shard
      b.feature_for = node_id if node.feature is None else None
      b.turn_limit = self._turn_limit(b)
      self.slots[slot] = b
      if self.record_steps:
        self.starts.append((slot, tree.uid))
      self._charge(st).rollouts_started += 1
    for j in range(0, max(map(len, src)), _COPY_BATCH):  # fixed batch: one compilation
      s_ids, d_ids = [], []
      for shard in range(self.shards):  # block per shard, padded with the shard's null page
        s, d = src[shard][j:j + _COPY_BATCH], dst[shard][j:j + _COPY_BATCH]
        pad = [self.alloc.null_page(shard)] * (_COPY_BATCH - len(s))
        s_ids += s + pad
        d_ids += d + pad
      self.pool = self._copy(self.pool, np.asarray(s_ids, np.int32), np.asarray(d_ids, np.int32))

  def _flush_prefill(self):
    """Runs queued prefill jobs [owner, pages, start, tokens, features|None] (owner: the branch or
    TreeState the work is charged to, None for scoring) in chunk/row
    buckets (a job with a features dict gets its final state at its last token and the sum of
    its final states, `prompt_features(keep=True)`); on a
    mesh each call holds a block of `prefill_rows` rows per data shard, each shard's own jobs."""
    cfg, jobs = self.cfg, [j for j in self._jobs if j[3]]
    self._jobs = []
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
        j[2] += t
        j[3] = j[3][t:]
        owner = j[0].state if isinstance(j[0], _Branch) else j[0]
        self._charge(owner).prefill_tokens += t
        rows_of.append((r, j))
      self.pool, last, total = self._prefill(self.state, self.pool, batch)
      if any(j[4] is not None for _, j in rows_of):  # scoring: read the rows' final states
        last, total = np.asarray(last), np.asarray(total)
        for r, j in rows_of:
          if j[4] is not None:
            j[4]["last"], j[4]["sum"] = last[r], j[4]["sum"] + total[r]
      jobs = [j for j in jobs if j[3]]

  def _budget(self, b: _Branch) -> int:
    """Decode steps of the next call: up to decode_steps, never past the turn or sequence limit."""
    if b.final:
      return 1
    return max(1, min(self.cfg.decode_steps, b.turn_limit - len(b.turn_ids),
                      self.cfg.max_seq_len - 1 - b.kv_len))

  def _ensure_pages(self, decoding):
    """Gives each decoding slot a page for its next write (a slot the pool cannot serve is cut),
    then pages for the rest of its step budget as far as the pool allows (the budget shrinks to
    the pages it got)."""
    ok, cut, ps = [], [], self.cfg.page_size
    for i in decoding:
      b = self.slots[i]
      if b.kv_len // ps >= len(b.pages):
        try:
          b.pages.extend(self.alloc.alloc(1, b.shard))
        except PoolExhaustedError:
          if b.final:  # the leaf is complete; only its feature is lost
            self._retire(i)
            continue
          b.end_reason = "pool_exhausted"
          cut.append(i)
          continue
      ok.append(i)
    for i in ok:
      b = self.slots[i]
      b.budget = self._budget(b)
      more = (b.kv_len + b.budget - 1) // ps + 1 - len(b.pages)
      if more > 0:
        b.pages.extend(self.alloc.alloc(min(more, self.alloc.num_free_in(b.shard)), b.shard))
        b.budget = min(b.budget, len(b.pages) * ps - b.kv_len)
    if cut:
      self._end_turns(cut)
    return ok

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
      need = -(-(b.kv_len + len(tokens)) // cfg.page_size) - len(b.pages)
      try:
        b.pages.extend(self.alloc.alloc(max(0, need), b.shard))
      except PoolExhaustedError:
        node.done, node.truncated, node.reward = True, "pool_exhausted", cfg.truncation_reward
        return
      self._jobs.append([b, b.pages, b.kv_len, tokens, None])
      b.kv_len += len(tokens)
      b.pending = obs[-1]
    b.state.kv[node.id] = (b.pages, b.kv_len)

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

  def _retire(self, i):
    b = self.slots[i]
    spare = b.pages[-(-b.kv_len // self.cfg.page_size):]  # pages taken ahead, never written
    if spare:
      del b.pages[len(b.pages) - len(spare):]
      self.alloc.decref(spare)
    b.state.page_refs.append(b.pages)  # pages stay alive for forks until release(trees)
    self.slots[i] = None
    b.state.outstanding -= 1
    if b.state.outstanding == 0 and self._on_trees_done is not None and not b.state.ahead:
      self._idle.append(b.tree)


__all__ = ["DEFAULT_STOP_STRINGS", "EnvStep", "ForkRequest", "Ledger", "PromptRequest",
           "SamplerConfig", "SamplerEngine", "TreeState", "TurnRef"]
