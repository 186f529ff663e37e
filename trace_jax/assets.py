"""Builds what a run needs from its config: the world or real data, tokenizer, model, retriever,
and the cached warm start. Everything expensive is cached on disk and reused when present."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time

import numpy as np
from flax import nnx

from trace_jax.checkpoint import Checkpointer
from trace_jax.envs import prompts
from trace_jax.models.qwen3 import Qwen3, from_pretrained, get_preset

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Assets:
  encode: object          # str -> list[int]
  decode: object          # list[int] -> str
  bos_id: int | None
  eos_id: int | None
  vocab_size: int
  train: list             # example dicts: prompt_ids, answers, question, id, hops, source
  test: list
  retriever: object
  world: object = None    # the synthetic world, when used


def _example(encode, bos_id, ex_id, question, answers, prompt_text, hops=None, source="synthetic",
             meta=None):
  ids = ([bos_id] if bos_id is not None else []) + list(encode(prompt_text))
  return dict(id=str(ex_id), question=question, answers=list(answers), prompt_ids=ids,
              hops=hops, source=source, meta=meta or {})


def load_world_assets(c) -> Assets:
  from trace_jax.envs.synthetic import SyntheticWorldConfig, World, build_tokenizer, generate_world

  wdir = os.path.join(c.world.cache_dir, f"world-seed{c.world.seed}")
  if os.path.exists(os.path.join(wdir, "world.json")):
    world = World.load(wdir)
  else:
    world = generate_world(SyntheticWorldConfig(seed=c.world.seed, topk=c.retriever.topk,
                                                max_turns=c.env.max_turns))
    world.save(wdir)
  tok = build_tokenizer(world)
  encode = lambda s: tok.encode(s).ids  # noqa: E731
  decode = lambda ids: tok.decode(list(ids), skip_special_tokens=False)  # noqa: E731
  bos, eos = tok.token_to_id("<bos>"), tok.token_to_id("<eos>")
  mk = lambda ex: _example(encode, bos, ex.id, ex.question, ex.answers,  # noqa: E731
                           prompts.synthetic_prompt(ex.question), hops=ex.hops, meta=ex.meta)
  return Assets(encode=encode, decode=decode, bos_id=bos, eos_id=eos,
                vocab_size=tok.get_vocab_size(), train=[mk(e) for e in world.train],
                test=[mk(e) for e in world.test], retriever=world.retriever(), world=world)


def load_real_assets(c) -> Assets:
  """Real multi-hop QA: local HF tokenizer, local data files, BM25 index or HTTP retriever."""
  from transformers import AutoTokenizer

  from trace_jax.data import load_qa

  tok = AutoTokenizer.from_pretrained(c.model.tokenizer_path or c.model.path, local_files_only=True)
  encode = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
  decode = lambda ids: tok.decode(list(ids))  # noqa: E731

  def mk(ex):
    return _example(encode, None, ex.id, ex.question, ex.answers,
                    prompts.build_search_r1_prompt(ex.question, tok), source=ex.source,
                    meta=ex.meta)
  train = [mk(e) for e in load_qa(c.data.train_path, format=c.data.format or None)]
  test = [mk(e) for e in load_qa(c.data.test_path, format=c.data.format or None)]
  if c.retriever.kind == "http":
    from trace_jax.envs.http_retriever import HTTPRetriever
    retriever = HTTPRetriever(c.retriever.url)
  elif c.retriever.kind == "bm25":
    from trace_jax.envs.retrieval import BM25Retriever
    p = c.retriever.index_path
    retriever = BM25Retriever.load(p) if os.path.isdir(p) else BM25Retriever.from_jsonl(p)
  else:
    raise ValueError(f"retriever.kind={c.retriever.kind!r} needs the synthetic world")
  return Assets(encode=encode, decode=decode, bos_id=None, eos_id=tok.eos_token_id,
                vocab_size=len(tok), train=train, test=test, retriever=retriever)


def build_model(c, vocab_size: int, mesh=None) -> Qwen3:
  if c.model.path:
    return from_pretrained(c.model.path, dtype=c.model.dtype, param_dtype=c.model.param_dtype,
                           mesh=mesh)
  overrides = dict(vocab_size=vocab_size, dtype=c.model.dtype, param_dtype=c.model.param_dtype)
  if c.model.preset == "tiny":
    overrides.update(hidden_size=c.model.hidden_size, num_layers=c.model.num_layers,
                     intermediate_size=c.model.intermediate_size)
  cfg = get_preset(c.model.preset, **overrides)
  return Qwen3(cfg, rngs=nnx.Rngs(sft_seed(c)))  # the init only matters to the warm start


def sft_seed(c) -> int:
  """Seed of the warm start (model init, expert traces, packing, order): `sft.seed`, or the run's
  seed when that is negative. A fixed `sft.seed` lets RL seeds share one warm start."""
  s = c.sft.get("seed", -1)
  return int(c.seed if s is None or s < 0 else s)


def warm_start_key(c) -> str:
  """Cache key of the warm start: everything that changes it, the effective seed included."""
  sft = {k: v for k, v in c.sft.to_dict().items() if k != "seed"}
  blob = json.dumps({"world": c.world.to_dict(), "model": c.model.to_dict(), "sft": sft,
                     "seed": sft_seed(c), "env": c.env.to_dict(), "topk": c.retriever.topk,
                     "v": 3}, sort_keys=True)
  return hashlib.sha1(blob.encode()).hexdigest()[:12]


def warm_start(c, assets: Assets, graphdef, params, log_fn=None):
  """Fine-tunes on the world's expert traces, or restores the cached result. Returns (params,
  info)."""
  from trace_jax.envs.synthetic import make_sft_dataset
  from trace_jax.sft import SFTConfig, encode_segments, pack_sequences, sft_train, target_positions

  d = os.path.abspath(os.path.join(c.world.cache_dir, f"warmstart-{warm_start_key(c)}"))
  ck = Checkpointer(d, max_to_keep=1)
  if ck.latest_step() is not None:
    params, meta = ck.restore(params)
    log.info("warm start restored from %s", d)
    return params, dict(meta, cached=True, path=d)
  t0 = time.time()
  seed = sft_seed(c)
  recs = make_sft_dataset(assets.world, c.sft.num_traces, np.random.default_rng(seed))
  seqs = [encode_segments(assets.encode, r.segments(), assets.bos_id) for r in recs]
  row_len = c.sft.row_len
  packed = target_positions(pack_sequences(seqs, row_len, np.random.default_rng(seed)),
                            row_len // 2)
  cfg = SFTConfig(steps=c.sft.steps, batch_rows=c.sft.batch_rows, lr=c.sft.lr,
                  warmup=c.sft.warmup, min_lr_ratio=c.sft.min_lr_ratio)
  params, hist = sft_train(graphdef, params, packed, cfg, seed=seed, log=log_fn)
  info = dict(steps=c.sft.steps, traces=len(recs),
              expert_success=float(np.mean([r.trace.correct for r in recs])),
              rows=int(packed["tokens"].shape[0]), truncated=int(packed["truncated"]),
              seconds=time.time() - t0, final=hist[-1] if hist else {})
  ck.save(c.sft.steps, params, info)
  return params, dict(info, cached=False, path=d)
