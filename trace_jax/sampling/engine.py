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
last partial page. The pages a tree's nodes use stay cached until `release(trees)`, so the trainer
can fork new branches from any anchor of a finished stage-1 tree. The engine keeps that
bookkeeping itself, by tree uid (`tree_state`); a `Tree` is plain data. A full pool never cuts a
rollout the pool could hold alone: cached K/V is evicted and branches are preempted, to resume
later by recomputing their K/V (`engine_preempt`).

On a mesh (`mesh=`), the pool's pages split into one contiguous range per data shard, each with
its own allocator range, block of slots and trees; KV heads split over `tensor`; everything that
indexes the pool runs per shard under `shard_map`, so no step gathers the pool.

Shapes are static (slots, pool, prefill and page-table buckets), so after warm-up no step compiles.
Token convention: the last token of a branch is *pending* (its K/V not yet written); the next
decode step writes it and samples from its logits, so that step's hidden state is the predictor
feature of the prefix ending at that token.

The engine is split by responsibility: this module holds `SamplerEngine` (construction, weights,
compile counts) and the sampling weight layout; `engine_admission` request admission, scheduling
and `run`; `engine_loop` the decode/prefill loop and turn ends; `engine_pages` the page
bookkeeping (`TreeState`, branches, release, rollback); `engine_preempt` eviction and
preemption on a full pool; `engine_features` prompt scoring and node features; `engine_ops` the
jitted device steps.
"""

from __future__ import annotations

import collections

import jax
import numpy as np
from flax import nnx

from trace_jax.parallel.sharding import DEFAULT_RULES, state_shardings, variable_value
from trace_jax.sampling import engine_ops, slot_tables
from trace_jax.sampling.config import (DEFAULT_STOP_STRINGS, EnvStep, ForkRequest, Ledger,
                                       PromptRequest, SamplerConfig, TurnRef)
from trace_jax.sampling.engine_admission import AdmissionMixin
from trace_jax.sampling.engine_features import PromptFeaturesMixin
from trace_jax.sampling.engine_loop import DecodeLoopMixin
from trace_jax.sampling.engine_pages import PageBookkeepingMixin, TreeState, _Branch
from trace_jax.sampling.engine_preempt import PreemptionMixin
from trace_jax.sampling.paged_kv import PageAllocator, PoolLayout, init_pool, make_copy_pages
# Names importable from this module before its split into engine_* modules, kept for callers.
from trace_jax.models.predictor import feature_width  # noqa: F401
from trace_jax.sampling.engine_admission import _COPY_BATCH  # noqa: F401
from trace_jax.sampling.engine_features import _PROMPT_MEANS_KEPT  # noqa: F401
from trace_jax.sampling.observation import fit_observation_ids  # noqa: F401
from trace_jax.sampling.paged_kv import PoolExhaustedError, tree_pages  # noqa: F401
from trace_jax.sampling.tree import Node, Tree  # noqa: F401


def sampling_shardings(state, layout: PoolLayout):
  """The sampler's weight layout on `layout.mesh`: the logical rules with `embed` unsplit (decode
  never gathers weights) and the batch over the pool's data axes; NamedShardings shaped like the
  nnx State `state`."""
  rules = tuple((k, None if k == "embed" else (layout.data_axes if k == "batch" else v))
                for k, v in DEFAULT_RULES)
  return state_shardings(state, layout.mesh, rules)


class SamplerEngine(AdmissionMixin, DecodeLoopMixin, PromptFeaturesMixin, PreemptionMixin,
                    PageBookkeepingMixin):
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
    # (prompts, prefill tokens) of recent `prompt_features` calls, since the last weight update:
    # the pool a run's rollouts ahead were chosen from is billed to the step that adopts them.
    self._scored: list[tuple[frozenset, int]] = []
    # Bounded and off by default: a training run makes millions of decode steps and never reads
    # them (see record_steps).
    self.record_steps = max(0, int(record_steps))
    self.step_log: collections.deque = collections.deque(maxlen=self.record_steps)
    self.starts: collections.deque = collections.deque(maxlen=self.record_steps)
    self._trees: dict[int, TreeState] = {}  # tree uid -> bookkeeping, admission to release
    self._next_uid = 0
    self._jobs: list = []
    # Partial pages of anchors queued for copy into new forks' pages: (src, dst) per data shard.
    self._copies = ([[] for _ in range(self.shards)], [[] for _ in range(self.shards)])
    self._start_seq = 0  # branches started so far (preemption priority: `engine_preempt`)
    self._on_trees_done, self._idle = None, []  # `run`'s callback and the trees it has to hear of
    self._pending: dict[int, collections.deque] = {}
    self.slot_worker = np.zeros(cfg.num_slots, np.int32)
    self.slot_shard = (np.arange(cfg.num_slots) * self.shards // cfg.num_slots).astype(np.int32)

  # ---- public API --------------------------------------------------------------------------------
  def update_params(self, params_state) -> None:
    """Swaps the sampling weights.

    Every live tree (the rollouts carried ahead, `run(ahead=...)`, in particular) records in
    `meta["stale_tokens"]` the tokens it has generated so far: their log-probs are the old
    policy's, which is what the update's ratio is taken against. The K/V cached so far was written
    under the old weights. A branch mid-turn continues under the new weights over that K/V, and a
    branch later forked from a node recorded before the swap (or by such a branch) does too:
    their tokens' log-probs come from the new weights over old K/V, neither policy's, and each
    such token is added to `meta["stale_tokens"]` as it is generated. Branches started from a
    root after the swap are clean: the prompt is prefilled again under the new weights (the old
    prompt pages stay the tree's until `release`)."""
    self.state = self._place(params_state)
    self._prompt_means.clear()  # computed under the old weights
    self.drop_kept()
    self._scored.clear()  # a pool scored under the old weights is billed by now
    stale = {uid: sum(len(n.gen_ids) for n in st.tree.nodes) for uid, st in self._trees.items()}
    for b in self.slots:
      if b is not None and b.tree.uid in stale:
        stale[b.tree.uid] += len(b.turn_ids)
    for uid, st in self._trees.items():
      st.tree.meta["stale_tokens"] = stale[uid]
    self._age_kv()

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


__all__ = ["DEFAULT_STOP_STRINGS", "EnvStep", "ForkRequest", "Ledger", "PromptRequest",
           "SamplerConfig", "SamplerEngine", "TreeState", "TurnRef"]
