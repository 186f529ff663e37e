"""One RL step's update side: the trained trees as packed rows, and PPO's minibatch loop over them.

`training_units` turns the step's trees into the units `rl.batch.pack_batch` lays out (one
sequence per leaf, or each tree's nodes once with tree packing); `pack_rows` packs them into the
update's rows (`update_rows`, `row_len`, `preds_per_row` size them); `ppo_updates` runs
`rl.ppo_epochs` x `rl.minibatches` jitted updates on them in the order `minibatch_order` draws.
`largest_tree` is the sampler-side bound the same config implies (the biggest tree a step starts).
The training loop (`trace_jax.train`) calls these; nothing here reads the loop's state.
"""

from __future__ import annotations

import jax
import numpy as np

from trace_jax.allocation import strategies
from trace_jax.config import TrainConfig
from trace_jax.loop_utils import host_tree
from trace_jax.parallel import shard_batch
from trace_jax.parallel.distributed import run_global
from trace_jax.models.blocked_attention import kv_block_lists, visible_block_fraction
from trace_jax.parallel.micro_batch import padded_rows, row_shards
from trace_jax.rl.batch import build_sequences, build_tree_units, pack_batch, row_buckets
from trace_jax.rl.update import reference_logprobs


def row_len(c: TrainConfig) -> int:
  """Tokens per update row: `env.max_seq_len`, or with tree packing `rl.pack_row_len` when set
  (longer rows keep bigger trees whole; a row's attention costs its length squared)."""
  if c.rl.packing == "tree" and c.rl.pack_row_len > 0:
    return c.rl.pack_row_len
  return c.env.max_seq_len


def preds_per_row(c: TrainConfig) -> int:
  """Predictor entries per packed row: three root-to-leaf paths' nodes unpacked; with tree
  packing (one entry per weighted node, a row holding a whole tree's nodes) eight paths' worth
  per `env.max_seq_len` tokens of row, and a unit is split before it holds more."""
  if c.rl.packing == "tree":
    return 8 * (c.env.max_turns + 2) * -(-row_len(c) // c.env.max_seq_len)
  return 3 * (c.env.max_turns + 2)


def training_units(c: TrainConfig, trees) -> list[dict]:
  """The step's trained trees as the units `pack_batch` lays out: one sequence per leaf
  (`rl.packing=none`) or each tree's nodes once per unit (`tree`), with the method's advantage
  estimator and the run's value estimator. The prompts the predictor's fit holds out
  (`rl.predictor_holdout`) give the head no target here either."""
  kw = dict(kind=strategies.advantage_for(c.method, c.rl.advantage),
            max_depth=c.env.max_turns + 2, normalize=c.rl.normalize_std,
            pred_leaf_weight=c.rl.predictor_leaf_weight, values=c.rl.tree_values,
            pred_holdout=c.rl.predictor_holdout)
  if c.rl.packing == "tree":
    return build_tree_units(trees, row_len=row_len(c), max_nodes=preds_per_row(c),
                            cut_len=c.env.max_seq_len, **kw)[0]
  return build_sequences(trees, **kw)[0]


def pack_rows(c: TrainConfig, mesh, units: list[dict]):
  """(batch, info) of `pack_batch`: a fixed `update_rows` rows unpacked; tree-packed, the
  smallest of `row_buckets` that holds the units (shapes follow the work), up to the token slots
  of `update_rows` rows of `env.max_seq_len`. With `rl.attention=blocked` the batch also
  carries each row's attention block lists (`with_block_lists`)."""
  rows = update_rows(c, mesh)
  if c.rl.packing == "tree":
    multiple = c.rl.micro_batches * c.rl.minibatches * row_shards(mesh if mesh.size > 1 else None)
    cap = -(-rows * c.env.max_seq_len // row_len(c))
    out = pack_batch(units, row_len(c), preds_per_row(c), buckets=row_buckets(cap, multiple))
  else:
    out = pack_batch(units, c.env.max_seq_len, preds_per_row(c), num_rows=rows)
  return with_block_lists(*out) if c.rl.attention == "blocked" else out


def with_block_lists(batch: dict, info: dict):
  """(batch, info) with `kv_blocks` / `kv_block_count` (`kv_block_lists` of the rows' kv_end and
  segments), the update's block-sparse attention; info gains `attention_blocks`, the listed share
  of the causal block pairs."""
  blocks, counts = kv_block_lists(batch.get("kv_end"), batch["segment_ids"])
  return (dict(batch, kv_blocks=blocks, kv_block_count=counts),
          dict(info, attention_blocks=visible_block_fraction(counts)))


def minibatch_order(rows: int, minibatches: int, epochs: int, seed: int, step: int):
  """The row indices of every optimizer step of one RL step: `epochs` passes over the packed
  rows, each split into `minibatches` equal groups; rows are shuffled per pass (from (seed, step),
  so a resumed step repeats its order) when there is more than one group. A list of i64 arrays."""
  size = rows // minibatches
  rng = np.random.default_rng([seed, step, 7])
  out = []
  for _ in range(epochs):
    order = rng.permutation(rows) if minibatches > 1 else np.arange(rows)
    out += [np.sort(order[i * size:(i + 1) * size]) for i in range(minibatches)]
  return out


def ppo_updates(c: TrainConfig, mesh, update, train_state, batch: dict, step: int, *,
                graphdef=None, ref_params=None, base=None):
  """`rl.ppo_epochs` x `rl.minibatches` optimizer steps on the packed batch (PPO's reuse of one
  step's rollouts; 1 x 1 is one step on everything). Every update sees the sampler's log-probs as
  the old policy, so from the second update on the ratio moves and the clip acts. Returns the new
  state and the step's record: each update metric's mean over the updates, the first and last
  update's clip fraction and approximate KL, and `optimizer_steps`.

  `update` is the jitted (train_state, minibatch) -> (train_state, metrics) on `mesh`; with
  `ref_params` (the frozen reference policy of `graphdef`) each minibatch gets its `ref_logp`.
  With LoRA, `update` takes the frozen `base` as a third argument (`rl.update.jit_update_step`)."""
  rows = len(batch["tokens"])
  sharded = mesh.size > 1
  groups = minibatch_order(rows, c.rl.minibatches, c.rl.ppo_epochs, c.seed, step)
  records = []
  for idx in groups:
    mb = {k: v[idx] for k, v in batch.items()} if len(groups) > 1 else batch
    if sharded:
      mb = shard_batch(mb, mesh)
    if ref_params is not None:
      mb["ref_logp"] = reference_logprobs(
          graphdef, ref_params, mb, c.rl.micro_batches,
          mesh if sharded else None, temperature=c.rollout.temperature)
    train_state, m = run_global(update, train_state, mb, *(() if base is None else (base,)))
    records.append({k: float(v) for k, v in jax.device_get(host_tree(m)).items()})
  out = {k: float(np.mean([r[k] for r in records])) for k in records[0]}
  for k in ("skipped", "finite"):  # a step counts as skipped if any of its updates was
    out[k] = (max if k == "skipped" else min)(r[k] for r in records)
  out["skip_streak"] = records[-1]["skip_streak"]
  out["param_norm"] = records[-1]["param_norm"]
  for k in ("clip_frac", "approx_kl"):
    out[f"{k}_first"], out[f"{k}_last"] = records[0][k], records[-1][k]
  out["optimizer_steps"] = float(len(records))
  return train_state, out


def largest_tree(c: TrainConfig) -> int:
  """The most rollouts one tree of a run starts from its root: a GRPO-style group (the whole
  per-step budget spread over the prompts), stage 1's per-prompt cap (bounded by what the budget
  leaves after every other prompt's minimum), the warm-start probe's 8 samples, or a metric-slice
  tree. Stage-2 continuations are not counted."""
  r = c.rollout
  n = max(int(r.prompts_per_step), 1)
  group = -(-(r.root_budget + r.prefix_budget) // n)
  cap = max(r.max_per_prompt, -(-r.root_budget // n))
  stage1 = min(cap, r.root_budget - (n - 1) * r.min_per_prompt)
  probe = 8 if c.eval.probe_prompts > 0 else 0
  slice_ = r.metric_rollouts if r.metric_slice > 0 else 0
  return int(max(group, stage1, probe, slice_))


def update_rows(c: TrainConfig, mesh) -> int:
  """Packed rows per update: `rl.train_rows` rounded up to a multiple of `rl.micro_batches` x the
  row shards of the mesh (data x fsdp) x `rl.minibatches`, so every minibatch's micro-batches
  split evenly over the shards."""
  return padded_rows(c.rl.train_rows, c.rl.micro_batches * c.rl.minibatches,
                     row_shards(mesh if mesh.size > 1 else None))
