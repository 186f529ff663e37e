"""Sampler configuration, request types, the environment callback contract and the cost ledger."""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Sequence

from trace_jax.sampling.tree import Node, Tree

DEFAULT_STOP_STRINGS = ("</search>", "</answer>")


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  """Static settings of a `SamplerEngine`: decode slots, the paged KV pool, limits, sampling.

  Every shape the engine compiles for derives from these fields, so one config means one set of
  compiled steps. `max_pages_per_seq` = ceil(max_seq_len / page_size).

  Example:
    >>> cfg = SamplerConfig(num_slots=4, page_size=16, max_seq_len=256, temperature=0.8)
    >>> cfg.max_pages_per_seq, cfg.group_size, cfg.num_groups
    (16, 4, 2)
  """

  num_slots: int = 8                # concurrent branches (decode batch)
  page_size: int = 16               # tokens per KV page
  num_pages: int = 1024             # pages in the pool (page 0 is the null page)
  max_seq_len: int = 512            # prompt + all turns + observations of one trajectory
  max_turn_tokens: int = 64         # generated tokens per turn
  max_obs_tokens: int = 64          # observation tokens kept per turn
  max_turns: int = 5                # turns per trajectory
  prefill_chunk: tuple = (32, 128)  # prefill chunk buckets (tokens per row per call)
  prefill_batch: int = 4            # rows per prefill call
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0                    # <= 0: off
  greedy: bool = False
  use_tree_attention: bool = True   # False: plain paged attention over each slot's full table
  share_prefix: bool = True         # False (ablation): a fork copies all of the anchor's pages
  max_group_size: int = 0           # branches per attention group; 0: min(num_slots, 8)
  max_groups: int = 0               # group rows of the tree kernel; 0: 2 * num_slots / group size
  page_buckets: tuple = ()          # page-table width buckets; (): powers of two
  attention_impl: str = "auto"      # tree kernel implementation (see kernels.dispatch.resolve_impl)
  leaf_features: bool = True        # one extra step per leaf to record its prefix feature
  prompt_mean_features: bool = False  # features [last state, mean of the prompt's final states]
  decode_steps: int = 8             # decode steps per device call (the host acts once per call)
  truncation_reward: float = 0.0    # reward of trajectories cut by a limit or the pool
  seed: int = 0

  @property
  def max_pages_per_seq(self) -> int:
    return -(-self.max_seq_len // self.page_size)

  @property
  def group_size(self) -> int:
    return self.max_group_size or min(self.num_slots, 8)

  @property
  def num_groups(self) -> int:
    return self.max_groups or max(1, -(-2 * self.num_slots // self.group_size))


@dataclasses.dataclass
class PromptRequest:
  """A new prompt sampled `n` times from its root; `meta` travels with the tree to the env.

  Example:
    >>> req = PromptRequest(prompt_ids=[3, 4, 5], n=4, meta={"answers": ["paris"]})
    >>> len(req.prompt_ids), req.n
    (3, 4)
  """
  prompt_ids: Sequence[int]
  n: int
  meta: dict | None = None
  prompt_text: str = ""
  uid: int | None = None  # the tree's uid (its rollouts' rng streams); None: the engine's next


@dataclasses.dataclass
class ForkRequest:
  """`k` new continuations of an existing tree from anchor node `node` (id or Node).

  Example:
    >>> gd, st = nnx.split(Qwen3(get_preset("tiny", vocab_size=32, num_layers=1), rngs=nnx.Rngs(0)))
    >>> cfg = SamplerConfig(num_slots=2, page_size=4, num_pages=64, max_seq_len=32,
    ...                     max_turn_tokens=4, prefill_chunk=(8,), page_buckets=(8,))
    >>> engine = SamplerEngine(gd, st, cfg, encode=lambda s: [], decode=lambda ids: str(ids),
    ...                        env_step=lambda calls: [(None, True, 1.0)] * len(calls), eos_id=None)
    >>> tree, = engine.run([PromptRequest([3, 4, 5], n=1)])
    >>> _ = engine.run([ForkRequest(tree, tree.leaves()[0].parent, k=2)])  # 2 more from the root
    >>> len(tree.leaves())
    3
  """
  tree: Tree
  node: int | Node
  k: int


class TurnRef(NamedTuple):
  """The rollout id handed to the environment: the tree (its `meta` has the question) and the new
  turn node (depth, parent, generated ids and text)."""
  tree: Tree
  node: Node


# env_step([(TurnRef, generated_text)]) -> [(observation_text | None, done, reward)]
EnvStep = Callable[[list], list]


@dataclasses.dataclass
class Ledger:
  rollouts_started: int = 0
  generated_tokens: int = 0
  prefill_tokens: int = 0
  tool_calls: int = 0
  decode_steps: int = 0
  busy_slot_steps: int = 0
  total_slot_steps: int = 0
  # Of the idle slot steps (total - busy): those of slots with no branch decoding in the call (no
  # work left for them, or waiting at a turn barrier); the rest are slots whose turn ended
  # inside a multi-step call (`decode_steps`) and idled until the call's end.
  empty_slot_steps: int = 0
  # Room-making for a full pool (`sampling.engine_preempt`): branches taken out of their slots to
  # resume later, and the tokens whose K/V was prefilled again (resumed branches, forks from
  # evicted nodes). Not in prefill_tokens: that is the prefill an ample pool would have done.
  preemptions: int = 0
  recomputed_tokens: int = 0

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


__all__ = ["DEFAULT_STOP_STRINGS", "EnvStep", "ForkRequest", "Ledger", "PromptRequest",
           "SamplerConfig", "TurnRef"]
