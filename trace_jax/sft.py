"""Supervised warm start on expert traces: packed sequences, loss on generated tokens only."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm


def encode_segments(encode: Callable[[str], list[int]], segments: Sequence[tuple[str, bool]],
                    bos_id: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """[(text, is_generated)] -> (ids i32[L], trainable bool[L]).

  Segments are encoded one by one, exactly as the sampler sees them (prompt, generated turns,
  observations appended by the environment), so the warm start and RL share one token layout.
  """
  ids, train = ([bos_id], [False]) if bos_id is not None else ([], [])
  for text, gen in segments:
    t = list(encode(text))
    ids += t
    train += [gen] * len(t)
  return np.asarray(ids, np.int32), np.asarray(train, bool)


def pack_sequences(seqs: Sequence[tuple[np.ndarray, np.ndarray]], row_len: int,
                   rng: np.random.Generator | None = None) -> dict[str, np.ndarray]:
  """Greedy first-fit packing of (ids, trainable) pairs into rows of `row_len` tokens.

  Returns tokens, segment_ids (0 = padding), positions (restarting per segment) and loss_mask
  (trainable targets, aligned with tokens: entry t is 1 when token t is trained), each [R, row_len].
  Sequences longer than a row are truncated (counted in `truncated`).
  """
  order = np.arange(len(seqs)) if rng is None else rng.permutation(len(seqs))
  rows, fill = [], []
  truncated = 0
  for i in order:
    ids, tr = seqs[i]
    if len(ids) > row_len:
      ids, tr, truncated = ids[:row_len], tr[:row_len], truncated + 1
    for r, f in enumerate(fill):
      if f + len(ids) <= row_len:
        rows[r].append((ids, tr))
        fill[r] += len(ids)
        break
    else:
      rows.append([(ids, tr)])
      fill.append(len(ids))
  n = len(rows)
  out = {k: np.zeros((n, row_len), np.int32) for k in ("tokens", "segment_ids", "positions")}
  out["loss_mask"] = np.zeros((n, row_len), np.float32)
  for r, row in enumerate(rows):
    at = 0
    for s, (ids, tr) in enumerate(row, start=1):
      L = len(ids)
      out["tokens"][r, at:at + L] = ids
      out["segment_ids"][r, at:at + L] = s
      out["positions"][r, at:at + L] = np.arange(L)
      out["loss_mask"][r, at:at + L] = tr
      at += L
  out["truncated"] = np.asarray(truncated)
  return out


def target_positions(packed: dict[str, np.ndarray], max_targets: int) -> dict[str, np.ndarray]:
  """Positions p (predicting token p + 1) of the trained targets of each row, padded to a static
  `max_targets` with weight 0, so the vocabulary projection runs only where a loss is taken.
  Targets past `max_targets` in a row are dropped and counted in `dropped_targets`."""
  seg, lm = packed["segment_ids"], packed["loss_mask"]
  ok = (lm[:, 1:] > 0) & (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
  n = ok.shape[0]
  pos = np.zeros((n, max_targets), np.int32)
  w = np.zeros((n, max_targets), np.float32)
  dropped = 0
  for r in range(n):
    idx = np.nonzero(ok[r])[0]
    dropped += max(len(idx) - max_targets, 0)
    idx = idx[:max_targets]
    pos[r, :len(idx)] = idx
    w[r, :len(idx)] = 1.0
  return dict(packed, target_pos=pos, target_w=w, dropped_targets=np.asarray(dropped))


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  steps: int = 1000
  batch_rows: int = 16
  lr: float = 3e-3
  warmup: int = 50
  min_lr_ratio: float = 0.05
  weight_decay: float = 0.01
  max_grad_norm: float = 1.0


def sft_loss(params, graphdef, batch):
  """Token-mean NLL of the trained targets; logits only at `target_pos` (see target_positions)."""
  model = nnx.merge(graphdef, params)
  out = model.forward(batch["tokens"], positions=batch["positions"],
                      segment_ids=batch["segment_ids"], compute_logits=False)
  pos = batch["target_pos"]
  h = jnp.take_along_axis(out["hidden"], pos[..., None], axis=1)
  logp = jax.nn.log_softmax(model.logits(h))
  tgt = jnp.take_along_axis(batch["tokens"], pos + 1, axis=1)
  nll = -jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
  m = batch["target_w"]
  n = jnp.maximum(m.sum(), 1.0)
  acc = ((jnp.argmax(logp, -1) == tgt) * m).sum() / n
  return (nll * m).sum() / n, {"nll": (nll * m).sum() / n, "token_acc": acc, "tokens": m.sum()}


def make_sft_step(graphdef, tx):
  def step(params, opt_state, batch):
    (loss, m), g = jax.value_and_grad(sft_loss, has_aux=True)(params, graphdef, batch)
    up, opt_state = tx.update(g, opt_state, params)
    return optax.apply_updates(params, up), opt_state, dict(m, grad_norm=optax.tree.norm(g))
  return jax.jit(step, donate_argnums=(0, 1))


def sft_train(graphdef, params, packed: dict[str, np.ndarray], cfg: SFTConfig, seed: int = 0,
              log: Callable[[int, dict], None] | None = None, desc: str = "warm start"):
  """Trains on packed rows (resampled each epoch); returns (params, history list of dicts)."""
  sched = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup,
                                             max(cfg.steps, cfg.warmup + 1),
                                             cfg.lr * cfg.min_lr_ratio)
  tx = optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm),
                   optax.adamw(sched, b1=0.9, b2=0.98, weight_decay=cfg.weight_decay))
  opt_state = tx.init(params)
  step = make_sft_step(graphdef, tx)
  rng = np.random.default_rng(seed)
  n_rows = packed["tokens"].shape[0]
  if n_rows < cfg.batch_rows:
    raise ValueError(f"only {n_rows} packed rows for batch_rows={cfg.batch_rows}")
  order, at = rng.permutation(n_rows), 0
  hist, t0, tokens = [], time.time(), 0.0
  bar = tqdm(range(cfg.steps), desc=desc, leave=False, mininterval=2.0)
  for i in bar:
    if at + cfg.batch_rows > n_rows:
      order, at = rng.permutation(n_rows), 0
    idx = order[at:at + cfg.batch_rows]
    at += cfg.batch_rows
    batch = {k: packed[k][idx] for k in ("tokens", "segment_ids", "positions", "target_pos",
                                         "target_w")}
    params, opt_state, m = step(params, opt_state, batch)
    if i % 25 == 0 or i == cfg.steps - 1:
      m = {k: float(v) for k, v in m.items()}
      tokens = (i + 1) * cfg.batch_rows * packed["tokens"].shape[1]
      m.update(step=i, lr=float(sched(i)), seconds=time.time() - t0,
               tokens_per_s=tokens / max(time.time() - t0, 1e-9))
      hist.append(m)
      bar.set_postfix(nll=f"{m['nll']:.3f}", acc=f"{m['token_acc']:.3f}")
      if log:
        log(i, m)
  return params, hist
