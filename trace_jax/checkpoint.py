"""Orbax checkpoints of a training state pytree plus JSON host metadata.

A training state is any pytree of arrays (params, optimizer states, step, rng key data). Restoring
takes an abstract target (`jax.ShapeDtypeStruct`s with shardings, e.g. from `abstract_like`) so the
arrays come back directly in their target sharding, on any mesh.
"""

from __future__ import annotations

import base64
import collections
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


def abstract_like(tree, shardings=None):
  """ShapeDtypeStructs of a pytree, with the given shardings (a matching pytree) or the arrays'."""
  if shardings is None:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                       sharding=getattr(x, "sharding", None)), tree)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                      shardings)


class Checkpointer:
  """Keeps the last `max_to_keep` checkpoints of (state, metadata) under `directory`."""

  def __init__(self, directory: str, max_to_keep: int = 3, save_interval_steps: int = 1):
    self.directory = os.path.abspath(directory)
    opts = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                        save_interval_steps=save_interval_steps, create=True)
    self._mgr = ocp.CheckpointManager(self.directory, options=opts,
                                      item_names=("state", "metadata"))

  def latest_step(self) -> int | None:
    return self._mgr.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._mgr.all_steps())

  def save(self, step: int, state: Any, metadata: dict | None = None, force: bool = False) -> bool:
    saved = self._mgr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        metadata=ocp.args.JsonSave(jsonable(metadata or {}))), force=force)
    self._mgr.wait_until_finished()
    return saved

  def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict]:
    """target: a pytree of arrays or ShapeDtypeStructs (with shardings) shaped like the state."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint found under {self.directory}")
    abstract = jax.tree.map(
        lambda x: x if isinstance(x, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=getattr(x, "sharding", None)), target)
    out = self._mgr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), metadata=ocp.args.JsonRestore()))
    return out["state"], dict(out["metadata"] or {})

  def metadata(self, step: int | None = None) -> dict:
    """The JSON metadata of checkpoint `step` (default: the latest), without reading the state."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint found under {self.directory}")
    out = self._mgr.restore(step, args=ocp.args.Composite(metadata=ocp.args.JsonRestore()))
    return dict(out["metadata"] or {})

  def close(self):
    self._mgr.close()


def jsonable(x):
  """numpy scalars and arrays (also nested in dicts and lists) as plain JSON values."""
  if isinstance(x, dict):
    return {str(k): jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [jsonable(v) for v in x]
  if isinstance(x, (np.integer,)):
    return int(x)
  if isinstance(x, (np.floating,)):
    return float(x)
  if isinstance(x, np.ndarray):
    return x.tolist()
  return x


def encode_host(x):
  """Host state (nested dicts, lists, tuples and deques of numpy arrays and scalars) as JSON
  values, arrays bit-exact (base64 of their bytes), for a checkpoint's metadata."""
  if isinstance(x, np.ndarray):
    return {"__ndarray__": base64.b64encode(np.ascontiguousarray(x).tobytes()).decode("ascii"),
            "dtype": x.dtype.str, "shape": list(x.shape)}
  if isinstance(x, dict):
    return {str(k): encode_host(v) for k, v in x.items()}
  if isinstance(x, (list, tuple, collections.deque)):
    return [encode_host(v) for v in x]
  return jsonable(x)


def decode_host(x):
  """Inverse of `encode_host` (tuples and deques come back as lists)."""
  if isinstance(x, dict):
    if "__ndarray__" in x:
      raw = base64.b64decode(x["__ndarray__"])
      return np.frombuffer(raw, dtype=np.dtype(x["dtype"])).reshape(x["shape"]).copy()
    return {k: decode_host(v) for k, v in x.items()}
  if isinstance(x, list):
    return [decode_host(v) for v in x]
  return x


# ---- a training run's checkpoint, read back by the launchers (eval, probes) ----------------------
def run_checkpoint_step(workdir: str, step: int | None = None) -> int:
  """The checkpoint step of a training run's `workdir` to restore: the latest unless `step` is
  given. Raises FileNotFoundError when the run saved none, ValueError for a step it did not save."""
  cdir = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(cdir):
    raise FileNotFoundError(f"{cdir} not found: the run saved no checkpoint yet (see ckpt.every)")
  ckpt = Checkpointer(cdir, max_to_keep=10**6)  # a reader must never delete old steps
  steps = sorted(ckpt.all_steps())
  ckpt.close()
  if not steps:
    raise FileNotFoundError(f"no checkpoint under {cdir}")
  if step is not None and step not in steps:
    raise ValueError(f"--step={step} not in {cdir}; saved steps: {steps}")
  return steps[-1] if step is None else step


def restore_target(c, graphdef, params, mesh=None):
  """The abstract train state a run's checkpoint holds (masters, optimizer states, predictor), each
  leaf a ShapeDtypeStruct placed as the train loop places it on `mesh` (nothing is allocated).
  `c` is the run's `trace_jax.config.TrainConfig` (`configs/convert.load_run_config`)."""
  from flax import nnx
  from jax.sharding import NamedSharding

  from trace_jax.models.predictor import PredictorHead, feature_width
  from trace_jax.config import update_config
  from trace_jax.rl.update import init_train_state, state_shardings

  # The head as the run built it (twice as wide when it read the prompt mean too).
  width = feature_width(nnx.merge(graphdef, params).cfg.hidden_size,
                        c.model.predictor_features)
  head = PredictorHead(width, c.model.predictor_hidden, rngs=nnx.Rngs(0))
  trained = params
  if c.model.lora.rank > 0:  # a LoRA run trains (and saves) adapters on a frozen base
    from trace_jax.models import lora

    lo = c.model.lora
    trained = jax.eval_shape(lambda: lora.adapt(graphdef, params, lo.rank, lo.alpha, lo.targets,
                                                0)[2])
  abstract = jax.eval_shape(lambda t: init_train_state(t, nnx.split(head)[1], update_config(c)),
                            trained)
  if mesh is None:  # every leaf on the first device (a checkpoint saved on any mesh restores here)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1),
                             ("data", "fsdp", "tensor"))
  place = lambda s, sub: jax.tree.map(  # noqa: E731
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), sub)
  return jax.tree.map(place, state_shardings(abstract, mesh), abstract,
                      is_leaf=lambda x: isinstance(x, NamedSharding))


def restore_run_policy(c, workdir, step, graphdef, params, mesh=None):
  """The policy weights of a run's checkpoint at `step`, as the train loop's sampler gets them:
  the train state's masters cast to `model.param_dtype` (`policy_params`), placed on `mesh` in
  the train loop's sharding. `c` is the run's config; `params` any weights of the run's shapes.
  A LoRA run (`model.lora.rank > 0`): `params` must be its base (the checkpoint records the base's
  fingerprint; another base is refused) and the adapters come back merged into it.
  Returns (params, step)."""
  from trace_jax.rl.update import policy_params

  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), max_to_keep=10**6)
  # The target gives the saved state's structure (optimizer states included); only params are used.
  state, meta = ckpt.restore(restore_target(c, graphdef, params, mesh), step)
  ckpt.close()
  if c.model.lora.rank > 0:
    from trace_jax.lora_run import LoraRun, check_checkpoint
    from trace_jax.models import lora

    run = LoraRun.build(c, graphdef, params, mesh)
    check_checkpoint(run, meta, workdir)
    return (lora.merged_weights(run.graphdef, run.base, state["params"]),
            int(meta.get("step", step)))
  return policy_params(state["params"], c.model.param_dtype), int(meta.get("step", step))
