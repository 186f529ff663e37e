"""Builds what a run needs from its config: the world or real data, tokenizer, model, retriever,
and the cached warm start. Everything expensive is cached on disk and reused when present."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os

import jax
from flax import nnx

from trace_jax.envs import prompts
from trace_jax.fileio import CorruptFileError, build_lock
from trace_jax.models.decoder import Decoder
from trace_jax.models.registry import build_model as build_family_model
from trace_jax.models.registry import from_pretrained, get_preset
from trace_jax.parallel.distributed import allgather_object

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Assets:
  """What a task gives a run (`trace_jax.tasks.Task.load`).

  Attributes:
    encode: the tokenizer, text -> list of token ids (the sampler encodes observations with it).
    decode: token ids -> text (the environment reads each generated turn as text).
    bos_id: the id put before every prompt (None: none), as in the examples' `prompt_ids`.
    eos_id: the id that ends a rollout when the policy writes it (None: none).
    vocab_size: the tokenizer's vocabulary size; every id must be below it (the model's
      embedding is made this large).
    train, test: example dicts, each with `prompt_ids` (the prompt's tokens, `bos_id` first:
      `make_example` builds one), `answers` (gold strings), `id`, and what the environment's
      `reset` reads; `hops`, `source`, `groups` split held-out EM when present.
    retriever: the search tool the default multi-hop environment calls (None for other tasks).
    world: the synthetic world, when the task has one (its diagnostics read it).
    env: the task's environment, a `trace_jax.envs.interface.ToolEnv` (None: the multi-hop search
      environment over `retriever`).
    reward_is_em: held-out accuracy is the environment's own reward of each greedy rollout (the
      default: the task's reward is its measure of success); False: exact match of the answer
      text against `answers`, as multi-hop QA reports it.
  """

  encode: object
  decode: object
  bos_id: int | None
  eos_id: int | None
  vocab_size: int
  train: list
  test: list
  retriever: object = None
  world: object = None
  env: object = None
  reward_is_em: bool = True

  def step_diagnostics(self, examples, trees) -> dict:
    """What the data source can say of a step's sampled trees beyond their rewards, logged with
    the step: on the synthetic world, where the rollouts went with trap-hop questions apart
    (`diagnostics.trap_allocation`); nothing on real data or other tasks."""
    if not hasattr(self.world, "traps"):
      return {}
    from trace_jax.diagnostics import trap_allocation
    return trap_allocation(examples, trees, self.world)

  @property
  def wants_eval_trees(self) -> bool:
    """Whether `eval_diagnostics` reads the held-out trees (a lessons world)."""
    return self.world is not None and bool(getattr(self.world, "lessons", None))

  def eval_diagnostics(self, trees) -> dict:
    """What held-out greedy trees say beyond EM, logged with the evaluation: on a lessons world,
    each lesson's fact-verb share among the policy's searches (`fact_verb/<relation>`) and
    how many lessons are above one half (`lessons_known`)."""
    if not self.wants_eval_trees:
      return {}
    from trace_jax.envs.worlds.lessons_world import wording_rates
    rates = wording_rates(self.world, trees)
    return {**{f"fact_verb/{r}": v for r, v in sorted(rates.items())},
            "lessons_known": sum(v > 0.5 for v in rates.values())}


REAL_VARIANTS = ("qwen3", "real")  # variant name prefixes that train on real data


def uses_real_data(c) -> bool:
  """Whether config `c` trains on a HF checkpoint, local QA files and a real retriever (the
  `qwen3_*` and `real_smoke` variants) rather than the synthetic world."""
  return str(c.variant).startswith(REAL_VARIANTS)


# The lessons world's own fields (`envs.worlds.lessons_world`); the tool tasks read the expert
# rates too.
LESSONS_FIELDS = ("n_relations", "n_wordings", "n_plain_relations", "one_lesson_per_question",
                  "zipf_exponent", "expert_rate_lo", "expert_rate_hi", "expert_rate_spacing",
                  "n_test", "balanced_test")
REAL_FIELDS = ("data.train_path", "data.test_path", "data.format", "data.eval_size", "model.path",
               "model.tokenizer_path")


def unread_fields(c) -> list[str]:
  """The run-config fields a run of `c` never reads (dotted names): a value given to one of them
  would be ignored, so a launcher refuses it. E.g. `data.train_path` on a synthetic variant, the
  retriever on a tool task, the synthetic world on real data."""
  out = []
  world = [f"world.{k}" for k in ("seed", "trap_rate", "kind") + LESSONS_FIELDS]
  if uses_real_data(c):
    out += world + [f"sft.{k}" for k in ("num_traces", "steps", "batch_rows", "row_len", "lr",
                                         "warmup", "min_lr_ratio", "seed", "traces")]
    out += ["model.hidden_size", "model.num_layers", "model.intermediate_size"]
  else:
    out += list(REAL_FIELDS)
    if c.task in ("math", "fc"):  # the embedded tool tasks: no world of entities, no search
      out += [f for f in world if f not in ("world.seed", "world.expert_rate_lo",
                                            "world.expert_rate_hi")]
      out += ["retriever.kind", "retriever.index_path", "retriever.url", "retriever.topk",
              "data.train_hops"]
    elif c.world.kind != "lessons":
      out += [f"world.{k}" for k in LESSONS_FIELDS]
  if c.retriever.kind != "http":
    out += ["retriever.url"]
  if c.retriever.kind != "bm25":
    out += ["retriever.index_path"]
  return sorted(set(out))


def make_example(encode, bos_id, ex_id, question, answers, prompt_text, hops=None,
                 source="synthetic", meta=None) -> dict:
  """An example dict as the loop reads it: the prompt's token ids (`bos_id` first when not None)
  under `prompt_ids`, the gold `answers`, what evaluation groups by (`hops`, `source`,
  `meta`)."""
  ids = ([bos_id] if bos_id is not None else []) + list(encode(prompt_text))
  return dict(id=str(ex_id), question=question, answers=list(answers), prompt_ids=ids,
              hops=hops, source=source, meta=meta or {})


def build_retriever(c, world=None):
  """The run's retriever (`retriever.kind`): the synthetic world's BM25, a local BM25 index, or
  an HTTP server. An HTTP retriever gets the config's timeout, retries and backoff and must pass
  a health check first (`retriever.health_check`), so a dead URL fails the run in seconds."""
  kind = c.retriever.kind
  if kind == "world":
    if world is None:
      raise ValueError("retriever.kind='world' needs the synthetic world; with real data use "
                       "'bm25' or 'http'")
    return world.retriever()
  if kind == "bm25":
    from trace_jax.envs.retrieval.bm25 import BM25Retriever
    p = c.retriever.index_path
    if not p or not os.path.exists(p):
      raise FileNotFoundError(f"retriever.index_path={p!r}: no such index directory or corpus")
    return BM25Retriever.load(p) if os.path.isdir(p) else BM25Retriever.from_jsonl(p)
  if kind == "http":
    from trace_jax.envs.retrieval.http_client import HTTPRetriever
    r = c.retriever
    retriever = HTTPRetriever(r.url, batch_size=r.batch_size, timeout_s=r.timeout_s,
                              max_retries=r.retries, backoff_s=r.backoff_s,
                              max_backoff_s=r.max_backoff_s, concurrency=r.concurrency)
    if r.health_check:
      check_retriever_health(retriever)
    return retriever
  raise ValueError(f"retriever.kind={kind!r}; choose world, bm25 or http")


class RetrieverHealthError(RuntimeError):
  """The retrieval server failed its start-up health check."""


def check_retriever_health(retriever, retries: int = 1) -> dict:
  """GET /health with at most `retries` retries; raises `RetrieverHealthError` naming the URL.

  Bounded by `retriever.worst_case_s(retries)`: about 2 x timeout_s for a hung server, well under
  a second for a refused connection."""
  from trace_jax.envs.retrieval.http_client import RetrieverError

  retries = min(retries, retriever.max_retries)
  try:
    info = retriever.health(retries=retries)
  except RetrieverError as e:
    raise RetrieverHealthError(
        f"retrieval server {retriever.url} failed its health check (GET {retriever.url}/health, "
        f"timeout {retriever.timeout_s}s, {retries} retries): {e}. Start it (python "
        f"launch/retrieval_server.py ...) or fix --config.retriever.url") from None
  if not isinstance(info, dict) or info.get("status") != "ok":
    raise RetrieverHealthError(f"retrieval server {retriever.url} is not healthy: "
                               f"GET /health answered {json.dumps(info)[:200]}")
  log.info("retrieval server %s healthy: %s", retriever.url, info)
  return info


def build_env(c, assets: "Assets"):
  """The run's `MultiHopEnv`: top-k passages per search, observations capped in bytes
  (`env.max_obs_bytes`) and in tokens (`env.max_obs_tokens`, under the policy's tokenizer) with
  the closing tag kept."""
  from trace_jax.envs.tasks.multihop import MultiHopEnv

  return MultiHopEnv(assets.retriever, c.env.reward, max_turns=c.env.max_turns,
                     topk=c.retriever.topk, max_obs_bytes=c.env.max_obs_bytes,
                     max_obs_tokens=c.env.max_obs_tokens, encode=assets.encode)


# What a local HF model directory must hold before anything is loaded from it.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_model_dir(path: str, tokenizer_path: str = "") -> None:
  """Fails with the missing file named when `path` is not a usable HF checkpoint directory
  (config.json, *.safetensors) or the tokenizer directory lacks tokenizer files."""
  if not path:
    raise ValueError("model.path is empty: set --config.model.path=/path/to/hf_checkpoint")
  if not os.path.isdir(path):
    raise FileNotFoundError(f"model.path={path}: not a directory (expected a local Hugging Face "
                            f"checkpoint with config.json and *.safetensors)")
  if not os.path.isfile(os.path.join(path, "config.json")):
    raise FileNotFoundError(f"model.path={path}: expected {os.path.join(path, 'config.json')}, "
                            f"which is missing (is this a Hugging Face checkpoint directory?)")
  if not any(n.endswith(".safetensors") for n in os.listdir(path)):
    raise FileNotFoundError(f"model.path={path}: no *.safetensors weights (expected e.g. "
                            f"{os.path.join(path, 'model.safetensors')} or sharded "
                            f"model-00001-of-0000N.safetensors files)")
  tdir = tokenizer_path or path
  field = "model.tokenizer_path" if tokenizer_path else "model.path"
  if not os.path.isdir(tdir):
    raise FileNotFoundError(f"{field}={tdir}: not a directory (expected tokenizer files)")
  if not any(os.path.isfile(os.path.join(tdir, n)) for n in _TOKENIZER_FILES):
    raise FileNotFoundError(f"{field}={tdir}: no tokenizer files (expected "
                            f"{os.path.join(tdir, 'tokenizer.json')}, or tokenizer.model, or "
                            f"vocab.json + merges.txt)")


def parse_hops(spec: str) -> tuple[int, ...]:
  """`data.train_hops` ("3,4") as a tuple of hop counts; () means every hop count."""
  spec = str(spec).strip()
  if not spec:
    return ()
  try:
    hops = tuple(sorted({int(x) for x in spec.split(",") if x.strip()}))
  except ValueError:
    raise ValueError(f"data.train_hops={spec!r} must be comma-separated hop counts such as "
                     f"'3,4' (or '' for all)") from None
  if not hops or min(hops) < 1:
    raise ValueError(f"data.train_hops={spec!r}: hop counts are integers >= 1")
  return hops


def select_hops(c, train: list) -> list:
  """The training examples whose hop count is in `data.train_hops` (all when it is empty); an
  example's hop count is its `hops` field or `meta["hops"]`. Held-out data is never filtered."""
  hops = set(parse_hops(c.data.train_hops))
  if not hops:
    return train
  count = lambda ex: ex.get("hops") if ex.get("hops") is not None else ex["meta"].get("hops")  # noqa: E731
  known = collections.Counter(count(ex) for ex in train)
  kept = [ex for ex in train if count(ex) in hops]
  if not kept:
    raise ValueError(f"data.train_hops={c.data.train_hops!r} keeps none of the {len(train)} "
                     f"training questions (hop counts present: "
                     f"{dict(sorted(known.items(), key=str))})")
  log.info("data.train_hops=%s: %d of %d training questions kept", c.data.train_hops, len(kept),
           len(train))
  return kept


def default_trap_rate() -> float:
  from trace_jax.envs.worlds.synthetic import SyntheticWorldConfig
  return SyntheticWorldConfig.trap_rate


def _trap_rate(c) -> float:
  return float(c.world.trap_rate)


def world_dir_name(c) -> str:
  """The world's cache directory under `world.cache_dir`: `world-seed{seed}`, with the trap rate
  appended when it is not the world's default (whose caches predate the option); a lessons world
  is `lessons-seed{seed}-{hash of its config}`."""
  if c.world.kind == "lessons":
    return _config_dir_name("lessons", lessons_world_config(c))
  rate = _trap_rate(c)
  return f"world-seed{c.world.seed}" + ("" if rate == default_trap_rate() else f"-trap{rate:g}")


def _config_dir_name(name: str, cfg, generator: int = 1) -> str:
  """`{name}-seed{seed}-{hash of the whole generator config}`: a cache directory per config, and
  per `generator` version (a world class's `GENERATOR`, raised when its code changes what a
  config generates; version 1 leaves the name as it was)."""
  d = dataclasses.asdict(cfg)
  if generator != 1:
    d["generator"] = generator
  blob = json.dumps(d, sort_keys=True)
  return f"{name}-seed{cfg.seed}-{hashlib.sha1(blob.encode()).hexdigest()[:8]}"


def cached_world(wdir: str, filename: str, generate, load):
  """The world cached in `wdir` (`load(wdir)`), or a new one (`generate()`, saved there
  atomically). Runs on one machine that need the same world take turns on a lock (the ones that
  wait find it built); several processes of one run share it: process 0 writes it, the others
  read it once written. A torn file (a run killed mid-write before saves were atomic) is rebuilt."""
  path, world = os.path.join(wdir, filename), None
  if jax.process_index() == 0:
    with build_lock(path + ".lock") if jax.process_count() == 1 else contextlib.nullcontext():
      if os.path.exists(path):
        try:
          world = load(wdir)
        except CorruptFileError as e:
          log.warning("%s; rebuilding it", e)
      if world is None:
        world = generate()
        world.save(wdir)
  if jax.process_count() > 1:
    allgather_object(None)  # a barrier: the cache is complete past it
  return load(wdir) if world is None else world


def lessons_world_config(c):
  """The `LessonsWorldConfig` of config `c`'s world section."""
  from trace_jax.envs.worlds.lessons_world import LessonsWorldConfig

  w = c.world
  return LessonsWorldConfig(
      seed=w.seed, n_relations=w.n_relations, n_wordings=w.n_wordings,
      n_plain_relations=w.n_plain_relations, one_lesson_per_question=w.one_lesson_per_question,
      zipf_exponent=w.zipf_exponent, expert_rate_range=(w.expert_rate_lo, w.expert_rate_hi),
      expert_rate_spacing=w.expert_rate_spacing, n_test=w.n_test, balanced_test=w.balanced_test,
      topk=c.retriever.topk, max_turns=c.env.max_turns)


def make_world(c):
  """A new synthetic world of config `c`'s kind (not cached: `load_world_assets` caches)."""
  from trace_jax.envs.worlds.lessons_world import generate_lessons_world
  from trace_jax.envs.worlds.synthetic import SyntheticWorldConfig, generate_world

  if c.world.kind == "lessons":
    return generate_lessons_world(lessons_world_config(c))
  return generate_world(SyntheticWorldConfig(seed=c.world.seed, topk=c.retriever.topk,
                                             max_turns=c.env.max_turns, trap_rate=_trap_rate(c)))


def seen_entities(world) -> set:
  """The entities of the world's train questions (every name their chains pass through): the names
  the expert traces write. A test question whose entity is among them is `entity_seen`."""
  return {x for e in world.train for x in e.meta["chain"]}


def world_examples(world, encode, bos_id, prompt_fn, split: str = "test") -> list[dict]:
  """A synthetic world's questions of `split` as example dicts (`make_example`). Test questions also
  say whether their entity is one the warm start learned to write (`entity_seen`): it appears in
  some train question's chain. The word-level tokenizer gives each name its own token, so a name
  never written in training is hard to copy, and held-out EM splits on it (`evaluate` reports
  both halves). A lessons world's examples carry their relations as `groups` (EM per lesson)."""
  seen = seen_entities(world) if split == "test" else None
  out = []
  for e in getattr(world, split):
    ex = make_example(encode, bos_id, e.id, e.question, e.answers, prompt_fn(e.question),
                      hops=e.hops, meta=e.meta)
    if world.lessons:  # the lessons a question needs: held-out EM is reported per lesson
      ex["groups"] = sorted(set(e.meta["relations"]) & set(world.lessons))
    out.append(ex if seen is None else dict(ex, entity_seen=e.meta["chain"][0] in seen))
  return out


def load_world_assets(c) -> Assets:
  from trace_jax.envs.worlds.synthetic import World, build_tokenizer

  # An HTTP retriever (e.g. launch/retrieval_server.py --world) is checked before anything else.
  served = build_retriever(c) if c.retriever.kind == "http" else None
  wdir = os.path.join(c.world.cache_dir, world_dir_name(c))
  world = cached_world(wdir, "world.json", lambda: make_world(c), World.load)
  if not world.train or not world.test:  # an empty test set would report NaN accuracy
    raise ValueError(f"the synthetic world in {wdir} has {len(world.train)} train and "
                     f"{len(world.test)} test questions; both must be non-empty (delete the "
                     f"directory to regenerate it)")
  tok = build_tokenizer(world)
  encode = lambda s: tok.encode(s).ids  # noqa: E731
  decode = lambda ids: tok.decode(list(ids), skip_special_tokens=False)  # noqa: E731
  bos, eos = tok.token_to_id("<bos>"), tok.token_to_id("<eos>")
  examples = functools.partial(world_examples, world, encode, bos, prompts.synthetic_prompt)
  return Assets(encode=encode, decode=decode, bos_id=bos, eos_id=eos,
                vocab_size=tok.get_vocab_size(), train=select_hops(c, examples("train")),
                test=examples("test"),
                retriever=served if served is not None else build_retriever(c, world),
                world=world, reward_is_em=False)


def tool_task_assets(c) -> Assets:
  """An embedded tool task (`envs.tasks.tool_tasks`: `task=math` or `fc`): its problems, generated
  from the world section's seed and expert rates and cached under `world.cache_dir`, its tokenizer,
  its environment; held-out EM is the environment's reward (math-verify's check, or the final
  state and the answer), also per template (`groups`)."""
  from trace_jax.envs.tasks.tool_tasks import EMBEDDED_TASKS

  spec = EMBEDDED_TASKS[c.task]
  cfg = spec.world_config(seed=c.world.seed,
                          expert_rate_range=(c.world.expert_rate_lo, c.world.expert_rate_hi))
  wdir = os.path.join(c.world.cache_dir, _config_dir_name(spec.name, cfg,
                                                         getattr(spec.world_cls, "GENERATOR", 1)))
  world = cached_world(wdir, spec.file, lambda: spec.generate(cfg), spec.world_cls.load)
  tok = spec.tokenizer(world)
  encode = lambda s: tok.encode(s).ids  # noqa: E731
  decode = lambda ids: tok.decode(list(ids), skip_special_tokens=False)  # noqa: E731
  bos, eos = tok.token_to_id("<bos>"), tok.token_to_id("<eos>")

  def examples(split):
    return [dict(make_example(encode, bos, p.id, spec.question(p), p.answers, spec.prompt(p),
                          source=spec.name, meta={"template": p.template}),
                 groups=[p.template], **spec.fields(p)) for p in getattr(world, split)]
  return Assets(encode=encode, decode=decode, bos_id=bos, eos_id=eos,
                vocab_size=tok.get_vocab_size(), train=examples("train"), test=examples("test"),
                retriever=None, world=world, env=spec.make_env(c.env.max_turns),
                reward_is_em=True)


def load_real_assets(c) -> Assets:
  """Real multi-hop QA: local HF tokenizer, local data files, BM25 index or HTTP retriever."""
  # Cheap checks first: files, then the retrieval server's health, then the data files.
  check_model_dir(c.model.path, c.model.tokenizer_path)
  retriever = build_retriever(c)
  raw_train, raw_test = load_examples(c, "train_path"), load_examples(c, "test_path")
  from transformers import AutoTokenizer

  tok = AutoTokenizer.from_pretrained(c.model.tokenizer_path or c.model.path, local_files_only=True)
  encode = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
  decode = lambda ids: tok.decode(list(ids))  # noqa: E731

  def mk(ex):
    return make_example(encode, None, ex.id, ex.question, ex.answers,
                    prompts.build_search_r1_prompt(ex.question, tok), source=ex.source,
                    meta=ex.meta)
  train, test = select_hops(c, [mk(e) for e in raw_train]), [mk(e) for e in raw_test]
  return Assets(encode=encode, decode=decode, bos_id=None, eos_id=tok.eos_token_id,
                vocab_size=len(tok), train=train, test=test, retriever=retriever,
                reward_is_em=False)


def load_examples(c, field: str) -> list:
  """`load_qa` of `c.data.<field>`; an error names the file when no example is usable (load_qa
  itself refuses empty, binary and directory paths)."""
  from trace_jax.data import load_qa

  path = getattr(c.data, field)
  if not path:
    raise ValueError(f"data.{field} is empty: set --config.data.{field}=/path/to/file")
  examples = load_qa(path, format=c.data.format or None)
  if not examples:
    raise ValueError(f"data.{field}={path}: no usable examples (every record lacks an answer or "
                     f"is unanswerable)")
  return examples


def build_model(c, vocab_size: int, mesh=None) -> Decoder:
  """The policy: the checkpoint at `model.path` (any family `trace_jax.models` reads), else a
  random init of `model.preset` (of its family)."""
  if c.model.path:
    return from_pretrained(c.model.path, dtype=c.model.dtype, param_dtype=c.model.param_dtype,
                           mesh=mesh)
  overrides = dict(vocab_size=vocab_size, dtype=c.model.dtype, param_dtype=c.model.param_dtype)
  if c.model.preset == "tiny":
    overrides.update(hidden_size=c.model.hidden_size, num_layers=c.model.num_layers,
                     intermediate_size=c.model.intermediate_size)
  cfg = get_preset(c.model.preset, **overrides)
  return build_family_model(cfg, nnx.Rngs(sft_seed(c)))  # the init only matters to the warm start


def sft_seed(c) -> int:
  """Seed of the warm start (model init, expert traces, packing, order): `sft.seed`, or the run's
  seed when that is negative. A fixed `sft.seed` lets RL seeds share one warm start."""
  s = c.sft.seed
  return int(c.seed if s < 0 else s)
