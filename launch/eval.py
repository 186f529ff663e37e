"""Greedy evaluation of a checkpoint: EM and F1 per source and averaged, written as JSON.

  # a training run (its config.json and latest Orbax checkpoint; --step picks another)
  python launch/eval.py --workdir=runs/smoke --out=runs/smoke/eval.json
  # the same run on a local dataset file of any supported format (trace_jax.data.load_qa)
  python launch/eval.py --workdir=runs/smoke --data=/data/test.jsonl --format=flashrag
  # a HF Qwen3 checkpoint (with its tokenizer) against a BM25 index or a retrieval server
  python launch/eval.py --model_path=/ckpt/Qwen3-8B --data=/data/hotpotqa_dev.parquet \
      --retriever=http:http://127.0.0.1:8000
  python launch/eval.py --model_path=/ckpt/Qwen3-8B --data=/data/nq.jsonl \
      --retriever=bm25:/data/wiki_bm25

Data default: the synthetic world's test split. Retriever: `world` (BM25 over the synthetic world's
passages), `bm25:PATH` (a saved index directory or a Search-R1 jsonl corpus) or `http:URL` (a
Search-R1 compatible /retrieve server). The JSON holds em/f1/n overall, per source (`per_source`),
their unweighted mean over sources (`macro`), EM by hops when the data has hops, and where the
checkpoint, data and retriever came from.
"""

import json
import os
import time

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

from absl import app, flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", None, "training run directory (config.json + "
                               "checkpoints/)")
_STEP = flags.DEFINE_integer("step", None, "checkpoint step of --workdir (default: the latest)")
_MODEL_PATH = flags.DEFINE_string("model_path", None, "HF Qwen3 checkpoint directory (config.json "
                                  "+ safetensors + tokenizer), instead of --workdir")
_TOKENIZER_PATH = flags.DEFINE_string("tokenizer_path", None, "tokenizer directory for "
                                      "--model_path (default: --model_path)")
_DATA = flags.DEFINE_list("data", None, "QA files (.jsonl/.json/.parquet/.csv), comma-separated; "
                          "default: the synthetic world's test split")
_FORMAT = flags.DEFINE_enum("format", None, ["searchr1", "flashrag", "hotpotqa", "2wiki",
                                             "musique", "bamboogle"], "format of --data "
                            "(default: detected)")
_SOURCE = flags.DEFINE_string("source", None, "source name of every example of --data (default: "
                              "each Search-R1 row's data_source, else the file's name)")
_RETRIEVER = flags.DEFINE_string("retriever", "world", "world | bm25:PATH | http:URL")
_OUT = flags.DEFINE_string("out", None, "output JSON (default: <workdir>/eval.json or eval.json)")
_LIMIT = flags.DEFINE_integer("limit", 0, "evaluate the first N examples of each file only (0: "
                              "all)")
_WORLD_CACHE = flags.DEFINE_string("world_cache_dir", None, "synthetic world cache (default: the "
                                   "run's world.cache_dir, else 'cache')")
_DTYPE = flags.DEFINE_string("dtype", None, "compute dtype for --model_path (default: the "
                             "config's)")
_REWARD = flags.DEFINE_string("reward", None, "environment reward (em | f1 | em_format); "
                              "default: the config's")
_TOPK = flags.DEFINE_integer("topk", None, "passages per search (default: the config's)")
_MAX_TURNS = flags.DEFINE_integer("max_turns", None, "turns per rollout (default: the config's)")
_MAX_TURN_TOKENS = flags.DEFINE_integer("max_turn_tokens", None, "tokens per turn")
_MAX_OBS_TOKENS = flags.DEFINE_integer("max_obs_tokens", None, "observation tokens per turn")
_MAX_SEQ_LEN = flags.DEFINE_integer("max_seq_len", None, "tokens per trajectory")
_NUM_SLOTS = flags.DEFINE_integer("num_slots", None, "concurrent rollouts of the sampler")
_NUM_PAGES = flags.DEFINE_integer("num_pages", None, "KV pages of the sampler")
_BATCH = flags.DEFINE_integer("batch", 256, "prompts per sampler call")
_MESH = flags.DEFINE_string("mesh", None, "device mesh, e.g. data:2,fsdp:2,tensor:2 (default: the "
                            "run's mesh with --workdir, all devices data-parallel with "
                            "--model_path)")


def _fail(msg: str):
  raise SystemExit(f"error: {msg}")


def _run_config(workdir: str):
  """The config a run was trained with (its config.json), as a ConfigDict to override."""
  import ml_collections

  from configs.runs import load_run_config_dict

  try:
    return ml_collections.ConfigDict(load_run_config_dict(workdir))
  except FileNotFoundError as e:
    _fail(str(e))


def _hf_config(model_path: str):
  """Evaluation settings for a HF checkpoint: the paper-scale config, pointed at the checkpoint."""
  from configs import mhqa

  if not os.path.isdir(model_path):
    _fail(f"--model_path={model_path!r} does not exist")
  if not os.path.exists(os.path.join(model_path, "config.json")):
    _fail(f"{model_path} has no config.json: --model_path must be a HF checkpoint directory")
  c = mhqa.get_config("qwen3_8b")
  c.model.path = model_path
  c.model.tokenizer_path = _TOKENIZER_PATH.value or model_path
  c.retriever.kind = "world"
  c.mesh = "data:-1,fsdp:1,tensor:1"
  return c


def _apply_overrides(c):
  """Command-line settings win over the run's config."""
  pairs = [(_DTYPE, ("model", "dtype")), (_REWARD, ("env", "reward")),
           (_TOPK, ("retriever", "topk")),
           (_MAX_TURNS, ("env", "max_turns")), (_MAX_TURN_TOKENS, ("env", "max_turn_tokens")),
           (_MAX_OBS_TOKENS, ("env", "max_obs_tokens")), (_MAX_SEQ_LEN, ("env", "max_seq_len")),
           (_NUM_SLOTS, ("rollout", "num_slots")), (_NUM_PAGES, ("rollout", "num_pages"))]
  for flag, (group, key) in pairs:
    if flag.value is not None:
      c[group][key] = flag.value
  if _DTYPE.value is not None:
    c.model.param_dtype = _DTYPE.value
  if _WORLD_CACHE.value is not None:
    c.world.cache_dir = _WORLD_CACHE.value
  if _MESH.value is not None:
    c.mesh = _MESH.value


def _check_retriever(spec: str) -> tuple[str, str]:
  """world | bm25:PATH | http:URL -> (kind, argument), failing early on a bad spec or path."""
  kind, _, arg = spec.partition(":")
  if not ((kind == "world" and not arg) or (kind in ("bm25", "http") and arg)):
    _fail(f"--retriever={spec!r}; expected world, bm25:PATH or http:URL")
  if kind == "bm25" and not os.path.exists(arg):
    _fail(f"--retriever={spec}: no such index directory or corpus file")
  return kind, arg


def _make_retriever(spec: str, world_fn):
  kind, arg = _check_retriever(spec)
  if kind == "world":
    return world_fn().retriever()
  if kind == "bm25":
    from trace_jax.envs.retrieval.bm25 import BM25Retriever
    return BM25Retriever.load(arg) if os.path.isdir(arg) else BM25Retriever.from_jsonl(arg)
  from trace_jax.envs.retrieval.http_client import HTTPRetriever
  return HTTPRetriever(arg)


def _checkpoint_step(workdir, step):
  """The checkpoint step to restore (the latest unless given), failing early when absent."""
  from trace_jax.checkpoint import run_checkpoint_step

  try:
    return run_checkpoint_step(workdir, step)
  except (FileNotFoundError, ValueError) as e:
    _fail(str(e))


def describe_policy(params, mesh) -> dict:
  """Dtypes, mesh and how many weight arrays are split over devices, for the output JSON."""
  import jax

  leaves = jax.tree.leaves(params)
  return dict(dtypes=sorted({str(x.dtype) for x in leaves}), mesh=dict(mesh.shape),
              arrays=len(leaves),
              sharded=sum(1 for x in leaves
                          if not getattr(x, "sharding", None)
                          or not x.sharding.is_fully_replicated))


def _examples_from_file(path, fmt, source, encode, bos_id, prompt_fn):
  """Examples of one QA file; without --source a file's examples are named after the file (e.g.
  hotpotqa.jsonl -> hotpotqa), except Search-R1 rows, which name their own data_source."""
  from trace_jax.assets import make_example
  from trace_jax.data import QAFormatError, load_qa

  try:
    exs, stats = load_qa(path, format=fmt, source=source, return_stats=True)
  except QAFormatError as e:
    _fail(str(e))
  stem = os.path.splitext(os.path.basename(path))[0]
  src = lambda e: e.source if source or stats.format == "searchr1" else stem
  out = [make_example(encode, bos_id, e.id, e.question, e.answers, prompt_fn(e.question),
                  hops=e.meta.get("hops") if isinstance(e.meta, dict) else None,
                  source=src(e), meta=e.meta) for e in exs]
  return out, dict(path=os.path.abspath(path), format=stats.format, records=stats.records,
                   kept=stats.kept, skipped=stats.skipped)


def summarize(res: dict, examples: list) -> dict:
  """EM/F1 overall, per source with counts, and their unweighted mean over sources."""
  counts = {}
  for e in examples:
    s = e.get("source", "default")
    counts[s] = counts.get(s, 0) + 1
  per_source = {s: dict(em=res["em_by_source"][s], f1=res["f1_by_source"][s], n=counts[s])
                for s in res["em_by_source"]}
  mean = lambda v: float(sum(v) / len(v)) if v else float("nan")
  return dict(em=res["em"], f1=res["f1"], n=res["n"], per_source=per_source,
              macro=dict(em=mean([v["em"] for v in per_source.values()]),
                         f1=mean([v["f1"] for v in per_source.values()])),
              em_by_hops={str(h): v for h, v in res["em_by_hops"].items()},
              em_by_seen=res["em_by_seen"], mean_turns=res["mean_turns"],
              generated_tokens=int(res["generated_tokens"]))


def main(argv):
  del argv
  t0 = time.time()
  absl_logging.set_verbosity(absl_logging.WARNING)  # checkpoint libraries log every restore at INFO
  if bool(_WORKDIR.value) == bool(_MODEL_PATH.value):
    _fail("give exactly one of --workdir (a training run) or --model_path (a HF checkpoint)")
  for p in _DATA.value or []:
    if not os.path.exists(p):
      _fail(f"--data: {p!r} does not exist")
  _check_retriever(_RETRIEVER.value)
  c = _run_config(_WORKDIR.value) if _WORKDIR.value else _hf_config(_MODEL_PATH.value)
  _apply_overrides(c)
  from trace_jax.config import TrainConfig
  try:
    c = TrainConfig.from_dict(c.to_dict())
  except ValueError as e:
    _fail(str(e))
  if c.task != "mhqa":
    _fail(f"this evaluates multi-hop QA checkpoints; a {c.task} run reports its held-out EM "
          f"in its metrics.jsonl every eval.every steps")
  step = _checkpoint_step(_WORKDIR.value, _STEP.value) if _WORKDIR.value else None

  import logging

  import numpy as np
  from flax import nnx

  from trace_jax import assets as assets_lib
  from trace_jax.config import sampler_config
  from trace_jax.envs import prompts
  from trace_jax.envs.adapter import TreeEnvAdapter
  from trace_jax.envs.tasks.multihop import MultiHopEnv
  from trace_jax.evaluate import evaluate
  from trace_jax.parallel import initialize, make_mesh, shard_state
  from trace_jax.sampling.engine import SamplerEngine

  logging.getLogger("bm25s").setLevel(logging.WARNING)
  world_box = {}

  def world():  # built (or read from its cache) only when the data or retriever needs it
    if "w" not in world_box:
      world_box["w"] = assets_lib.load_world_assets(c)
    return world_box["w"].world

  # ---- mesh, tokenizer and model -----------------------------------------------------------------
  initialize()  # joins the other processes of a multi-host evaluation, if configured
  try:
    mesh = make_mesh(c.mesh or "data:-1")
  except ValueError as e:
    _fail(f"mesh {c.mesh!r}: {e} (set --mesh, e.g. --mesh=data:-1)")
  pmesh = mesh if mesh.size > 1 else None
  if _WORKDIR.value:
    synthetic = not assets_lib.uses_real_data(c)
    if synthetic:
      wa = world_box["w"] = assets_lib.load_world_assets(c)
      encode, decode, bos_id, eos_id, vocab = wa.encode, wa.decode, wa.bos_id, wa.eos_id, \
          wa.vocab_size
    model = assets_lib.build_model(c, vocab if synthetic else 0, pmesh if c.model.path else None)
  else:
    synthetic = False
    model = assets_lib.build_model(c, 0, pmesh)
  if not synthetic:
    from transformers import AutoTokenizer
    tdir = c.model.tokenizer_path or c.model.path
    try:
      tok = AutoTokenizer.from_pretrained(tdir, local_files_only=True)
    except (OSError, ValueError) as e:
      _fail(f"cannot load a tokenizer from {tdir!r} (set --tokenizer_path): {e}")
    encode = lambda s: tok.encode(s, add_special_tokens=False)
    decode = lambda ids: tok.decode(list(ids))
    bos_id, eos_id = None, tok.eos_token_id
  graphdef, params = nnx.split(model)
  if pmesh is not None:  # a synthetic-world model is born unsharded; place it as training does
    params = shard_state(params, pmesh)
  ckpt_info = {}
  if _WORKDIR.value:
    from trace_jax.checkpoint import restore_run_policy
    params, step = restore_run_policy(c, _WORKDIR.value, step, graphdef, params, pmesh)
    ckpt_info = dict(workdir=os.path.abspath(_WORKDIR.value), step=step)
  else:
    ckpt_info = dict(model_path=os.path.abspath(_MODEL_PATH.value))

  # ---- data and retriever -----------------------------------------------------------------------
  prompt_fn = prompts.synthetic_prompt if synthetic else \
      (lambda q: prompts.build_search_r1_prompt(q, tok))
  if _DATA.value:
    examples, data_info = [], []
    for p in _DATA.value:
      exs, info = _examples_from_file(p, _FORMAT.value, _SOURCE.value, encode, bos_id, prompt_fn)
      examples += exs[:_LIMIT.value or None]
      data_info.append(info)
  else:
    w = world()
    examples = assets_lib.world_examples(w, encode, bos_id, prompt_fn)  # seen/unseen marked
    data_info = [dict(path=None, format="synthetic_world_test", kept=len(examples))]
    examples = examples[:_LIMIT.value or None]
  if not examples:
    _fail("no examples to evaluate")
  retriever, retr_desc = _make_retriever(_RETRIEVER.value, world), _RETRIEVER.value

  # ---- sampler and evaluation -------------------------------------------------------------------
  env = MultiHopEnv(retriever, c.env.reward, max_turns=c.env.max_turns, topk=c.retriever.topk)
  longest = max(len(e["prompt_ids"]) for e in examples)
  if longest >= c.env.max_seq_len:
    _fail(f"a prompt has {longest} tokens, not below max_seq_len={c.env.max_seq_len} "
          f"(raise --max_seq_len)")
  scfg = sampler_config(c)  # evaluation is greedy whatever the temperature
  try:  # on a mesh as the train loop samples: pages and slots split over the data shards
    engine = SamplerEngine(graphdef, params, scfg, encode, decode,
                           TreeEnvAdapter(env), eos_id,
                           mesh=mesh if mesh.size > 1 else None,
                           stop_strings=env.stop_strings,
                         observation_close=env.observation_close)
    engine.check_rollout_fits("a greedy rollout")
  except ValueError as e:
    _fail(f"sampler on mesh {dict(mesh.shape)}: {e}")
  res = evaluate(engine, examples, batch=_BATCH.value)
  out = dict(summarize(res, examples), checkpoint=ckpt_info, data=data_info,
             retriever=retr_desc, reward=c.env.reward, max_turns=c.env.max_turns,
             policy=describe_policy(params, mesh), seconds=time.time() - t0)
  path = _OUT.value or (os.path.join(_WORKDIR.value, "eval.json") if _WORKDIR.value else
                        "eval.json")
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(out, f, indent=1,
              default=lambda x: float(x) if isinstance(x, np.floating) else str(x))
  per = "  ".join(f"{s}: EM {v['em']:.3f} F1 {v['f1']:.3f} (n={v['n']})"
                  for s, v in out["per_source"].items())
  print(f"EM {out['em']:.3f} F1 {out['f1']:.3f} over {out['n']} examples; {per}\nwrote {path}",
        flush=True)


if __name__ == "__main__":
  app.run(main)
