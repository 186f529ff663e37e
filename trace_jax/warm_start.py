"""The warm start: supervised fine-tuning on a task's expert traces before RL, cached on disk.

`warm_start(c, assets, graphdef, params)` restores the cached result or trains it (once per machine:
runs that need the same warm start take turns on a lock); `warm_start_key` names the cache by
everything that changes it; `warm_start_data` and `data_fingerprints` give its training data and
their fingerprints (bit-identical on every machine for a config).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from trace_jax.assets import Assets, default_trap_rate, sft_seed
from trace_jax.checkpoint import Checkpointer
from trace_jax.fileio import build_lock
from trace_jax.parallel.distributed import broadcast_arrays, broadcast_object, put_global
from trace_jax.provenance import (fingerprint, text_fingerprint, tree_fingerprint,
                                  world_fingerprint)

log = logging.getLogger(__name__)


# Where the cache lives is not what it holds.
_NOT_IN_WARM_START_KEY = ("max_obs_bytes", "predictor_features", "cache_dir")
# Settings added later that do change the expert traces: in the key only away from the default they
# were added with, so the caches made before them stay valid.
_IN_WARM_START_KEY_OFF_DEFAULT = {"trap_rate": default_trap_rate}


def _key_section(section) -> dict:
  out = {}
  for k, v in dataclasses.asdict(section).items():
    default = _IN_WARM_START_KEY_OFF_DEFAULT.get(k)
    if k not in _NOT_IN_WARM_START_KEY and not (default is not None and v == default()):
      out[k] = v
  return out


def warm_start_key(c, data_sha1: str | None = None) -> str:
  """Cache key of the warm start: everything that changes it, the effective seed included.
  `data_sha1` (`warm_start_sample_sha1`) ties it to the data's content, so a change to the
  expert's traces or to the tokenizer's words misses the cache instead of restoring parameters
  trained on other data (or with another vocabulary)."""
  sft = {k: v for k, v in dataclasses.asdict(c.sft).items() if k != "seed"}
  env, model, world = _key_section(c.env), _key_section(c.model), _key_section(c.world)
  if c.world.kind != "lessons":  # the lessons world's fields shape nothing else
    world = {k: v for k, v in world.items() if k in ("seed", "trap_rate", "kind")}
  blob = json.dumps({"world": world, "model": model, "sft": sft, "task": c.task,
                     "seed": sft_seed(c), "env": env, "topk": c.retriever.topk,
                     "data": data_sha1, "v": 5}, sort_keys=True)
  return hashlib.sha1(blob.encode()).hexdigest()[:12]


@dataclasses.dataclass
class TraceRecord:
  """A warm-start trace as [(text, is_generated)] segments and whether its answer is right."""
  segs: list
  correct: bool

  def segments(self) -> list:
    return self.segs


def warm_start_data(c, assets: Assets, num_traces: int | None = None,
                    examples: list | None = None, task=None) -> tuple[list, dict]:
  """The warm start's training data: `num_traces` (default `sft.num_traces`) traces of the task's
  (`task`, default the registered `c.task`; `Task.traces`) expert on its train split (or on
  `examples`, world questions) and their packed rows (`sft.pack_sequences`,
  `sft.target_positions`). Bit-identical on every machine for a given config
  (`data_fingerprints`)."""
  from trace_jax import tasks
  from trace_jax.sft import encode_segments, pack_sequences, target_positions

  task = task or tasks.get(c.task)
  if task.traces is None:
    raise ValueError(f"task {task.name!r} has no expert traces (Task.traces) to warm-start on")
  seed = sft_seed(c)
  n = c.sft.num_traces if num_traces is None else num_traces
  rng = np.random.default_rng(seed)
  got = (task.traces(c, assets, n, rng) if examples is None
         else task.traces(c, assets, n, rng, examples=examples))
  recs = [TraceRecord(*_check_trace(t, i, task.name)) for i, t in enumerate(got)]
  seqs = [encode_segments(assets.encode, r.segments(), assets.bos_id) for r in recs]
  row_len = c.sft.row_len
  packed = target_positions(pack_sequences(seqs, row_len, np.random.default_rng(seed)),
                            row_len // 2)
  return recs, packed


def _check_trace(t, i: int, name: str) -> tuple[list, bool]:
  """(segments, correct) of trace `t`, or a ValueError naming what is wrong with it."""
  ok = (isinstance(t, (tuple, list)) and len(t) == 2 and isinstance(t[0], (list, tuple))
        and all(isinstance(s, (tuple, list)) and len(s) == 2 and isinstance(s[0], str)
                for s in t[0]))
  if not ok:
    raise ValueError(f"task {name!r}: trace {i} is {str(t)[:200]!r}; Task.traces must return "
                     f"(segments, correct) pairs, segments a list of (text, is_generated)")
  if not any(gen for _, gen in t[0]):
    raise ValueError(f"task {name!r}: trace {i} has no generated segment to learn from")
  return list(t[0]), bool(t[1])


def warm_start_sample_sha1(c, assets: Assets, n: int = 64, task=None) -> str:
  """Fingerprint of the first `n` warm-start traces as packed token rows: changes with the
  expert's code, the world and the tokenizer's vocabulary; a fraction of a second to compute."""
  _, packed = warm_start_data(c, assets, num_traces=n, task=task)
  return fingerprint(*_packed_arrays(packed), np.asarray([assets.vocab_size]))


def _packed_arrays(packed: dict) -> list:
  """The array fields of packed warm-start rows, in name order (what their fingerprints hash)."""
  return [packed[k] for k in sorted(packed) if isinstance(packed[k], np.ndarray)]


def data_fingerprints(c, assets: Assets, num_traces: int | None = None) -> dict:
  """Fingerprints of what a synthetic run is built from: the world (`world_fingerprint`), its
  expert traces (their texts) and the packed warm-start rows (`fingerprint` of tokens and loss
  mask), with the row count. None of it may depend on the machine; `tests/test_provenance.py`
  holds committed values."""
  recs, packed = warm_start_data(c, assets, num_traces)
  if hasattr(assets.world, "corpus"):
    world = world_fingerprint(assets.world)
  else:  # a tool task's problems, whole (their states and numbers as well as their texts)
    world = text_fingerprint(json.dumps(dataclasses.asdict(p), sort_keys=True)
                             for p in assets.world.train + assets.world.test)
  return dict(world=world,
              traces=text_fingerprint(t for r in recs for seg in r.segments() for t in
                                      (seg[0], str(int(seg[1])))),
              sft_rows=int(packed["tokens"].shape[0]),
              sft_data=fingerprint(*_packed_arrays(packed)))


def warm_start(c, assets: Assets, graphdef, params, log_fn=None, task=None):
  """Fine-tunes on the task's expert traces (`task`, default the registered `c.task`:
  `tasks.Task.traces`), or restores the cached result. Returns (params, info). Independent runs
  on one machine that need the same warm start build it once: the first holds a lock on it while
  it trains, the others wait and restore it. (A multi-process run needs no lock: its process 0
  decides for all.)"""
  key = warm_start_key(c, warm_start_sample_sha1(c, assets, task=task))
  d = os.path.abspath(os.path.join(c.world.cache_dir, f"warmstart-{key}"))
  multi = jax.process_count() > 1
  with contextlib.nullcontext() if multi else build_lock(d + ".lock"):
    return _restore_or_train(c, assets, graphdef, params, d, multi, log_fn, task)


def _restore_or_train(c, assets, graphdef, params, d, multi, log_fn, task=None):
  from trace_jax.sft import SFTConfig, sft_train

  ck = Checkpointer(d, max_to_keep=1)
  # Several processes: the cached params live on every device, replicated (orbax writes them
  # collectively), and every process comes back with process 0's values on its own device.
  everywhere = NamedSharding(Mesh(np.asarray(jax.devices()), ("all",)), P()) if multi else None
  latest = ck.latest_step()
  if multi:
    latest = broadcast_object(latest)  # process 0's view decides for all
  if latest is not None:
    if multi:
      target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=everywhere),
                            params)
      restored, meta = ck.restore(target)
      params = jax.tree.map(lambda x: x.addressable_data(0), restored)
    else:
      params, meta = ck.restore(params)
    log.info("warm start restored from %s", d)
    return params, dict(meta, cached=True, path=d, params_sha1=tree_fingerprint(params))
  t0 = time.time()
  seed = sft_seed(c)
  recs, packed = warm_start_data(c, assets, task=task)
  cfg = SFTConfig(steps=c.sft.steps, batch_rows=c.sft.batch_rows, lr=c.sft.lr,
                  warmup=c.sft.warmup, min_lr_ratio=c.sft.min_lr_ratio)
  params, hist = sft_train(graphdef, params, packed, cfg, seed=seed, log=log_fn)
  info = dict(steps=c.sft.steps, traces=len(recs),
              expert_success=float(np.mean([r.correct for r in recs])),
              rows=int(packed["tokens"].shape[0]), truncated=int(packed["truncated"]),
              seconds=time.time() - t0, final=hist[-1] if hist else {},
              data_sha1=fingerprint(packed["tokens"]))
  if multi:  # the processes trained alike; process 0's result is the one every process keeps
    params = broadcast_arrays(params)
    ck.save(c.sft.steps, jax.tree.map(lambda x: put_global(x, everywhere), params), info)
  else:
    ck.save(c.sft.steps, params, info)
  return params, dict(info, cached=False, path=d, params_sha1=tree_fingerprint(params))
