"""A training run with LoRA (`model.lora.rank > 0`): the frozen base, the adapted graph, and what
the loop asks of them.

The run keeps one copy of the base's weights, in `model.param_dtype`, outside the train state: the
jitted update reads it (never donated), the KL reference is the base itself (adapters off: the
plain graph on the same arrays, no copy), and the sampler gets the base with the adapters folded
in once per step (`model.lora.sampler=merged`) or the base and the adapters as they are
(`unmerged`: the low-rank product in every matmul, no second copy of the weights). The train
state's `params` are the f32 adapters, with f32 Adam moments; the predictor head is trained whole,
as without LoRA. A checkpoint then holds the adapters and the head, and its metadata the base's
fingerprint (`models.lora.fingerprint`): a resume onto another base is refused
(`check_checkpoint`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trace_jax.models import lora as lora_lib
from trace_jax.parallel import shard_state


@dataclasses.dataclass
class LoraRun:
  """The frozen base of a LoRA run and the adapted graph."""
  graphdef: Any        # the adapted model's graph (the update's; the engine's when unmerged)
  plain_graphdef: Any  # the base's graph (the KL reference's; the engine's when merged)
  base: Any            # nnx.State of the base's weights, model.param_dtype, frozen
  adapters: Any        # the adapters at initialization (B = 0), f32
  fingerprint: str     # of `base`
  settings: dict       # rank, alpha, targets, sampler

  @classmethod
  def build(cls, c, graphdef, params, mesh=None, seed: int | None = None) -> "LoraRun":
    """`params` (a model of `graphdef`, on `mesh` already when it has several devices) become
    the frozen base; fresh adapters from `seed` (default: the run's seed + 2), placed in their
    base's logical sharding on `mesh`."""
    lo = c.model.lora
    targets = lora_lib.parse_targets(lo.targets)
    seed = c.seed + 2 if seed is None else seed
    lgraph, base, adapters = lora_lib.adapt(graphdef, params, lo.rank, lo.alpha, targets, seed)
    if mesh is not None and mesh.size > 1:
      adapters = shard_state(adapters, mesh)
    settings = dict(rank=lo.rank, alpha=float(lo.alpha), targets=",".join(targets),
                    sampler=lo.sampler)
    return cls(graphdef=lgraph, plain_graphdef=graphdef, base=base, adapters=adapters,
               fingerprint=lora_lib.fingerprint(base), settings=settings)

  @property
  def merged(self) -> bool:
    return self.settings["sampler"] == "merged"

  @property
  def sampler_graphdef(self):
    """The graph the sampler engine is built on."""
    return self.plain_graphdef if self.merged else self.graphdef

  def sampler_weights(self, adapters):
    """The sampler's weights under `adapters`: merged (a new copy, W's dtype) or base and
    adapters side by side."""
    if self.merged:
      return lora_lib.merged_weights(self.graphdef, self.base, adapters)
    return lora_lib.combined(self.base, adapters)

  def update_kwargs(self, mesh, shardings) -> dict:
    """`jit_update_step`'s LoRA arguments: the update takes the base as a third argument (in its
    logical sharding when the train state has shardings)."""
    from trace_jax.rl.update import state_shardings

    return dict(lora=True,
                base_shardings=state_shardings(self.base, mesh) if shardings is not None else None)

  def merged_model(self, adapters):
    """The plain model with the merged weights (`save_pretrained` exports it)."""
    return lora_lib.merged_model(self.graphdef, self.base, adapters)

  def meta(self) -> dict:
    """What a checkpoint records of the run's LoRA: its settings and the base's fingerprint."""
    return dict(self.settings, base_fingerprint=self.fingerprint)


def check_checkpoint(lora: LoraRun | None, meta: dict, where: str) -> None:
  """Raises ValueError when the checkpoint at `where` (its metadata `meta`) does not fit the run:
  adapters trained on another base, other adapter shapes, or LoRA on one side only."""
  saved = meta.get("lora")
  if lora is None and saved is None:
    return
  if lora is None:
    raise ValueError(f"the checkpoint under {where} holds LoRA adapters (rank {saved['rank']}) "
                     f"and this run fine-tunes every weight: resume with "
                     f"--config.model.lora.rank={saved['rank']}, or use a new workdir")
  if saved is None:
    raise ValueError(f"the checkpoint under {where} is a full fine-tuning state and this run "
                     f"trains LoRA adapters (model.lora.rank={lora.settings['rank']}): resume "
                     f"with --config.model.lora.rank=0, or use a new workdir")
  if saved["base_fingerprint"] != lora.fingerprint:
    raise ValueError(f"the checkpoint under {where} holds adapters trained on another base "
                     f"(fingerprint {saved['base_fingerprint']}; this run's base is "
                     f"{lora.fingerprint}): resume with the same model.path and warm start, or "
                     f"use a new workdir")
  for k in ("rank", "alpha", "targets"):
    if saved[k] != lora.settings[k]:
      raise ValueError(f"the checkpoint under {where} has model.lora.{k}={saved[k]!r}, this run "
                       f"{lora.settings[k]!r}: resume with the checkpoint's value")
