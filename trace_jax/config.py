"""The typed configuration of a training run: frozen dataclasses, one per section.

Every knob is defined once, here: its default, a one-line doc and the values it allows
(`knob(default, doc, choices=..., ge=..., gt=..., le=..., lt=...)`). Everything else derives from
that definition: the ConfigDict the config files start from (`configs/base.py`), the field checks
of `check_knobs` (`configs/convert.py` adds the checks that relate several fields), the reference
in `configs/README.md` (`knob_table`), and the parts' own configs where they share a field
(`trace_jax.allocation.driver.DriverConfig` is the rollout section plus the method).

The library reads only these. Build one in Python with `TrainConfig()` (the defaults),
`TrainConfig.from_dict(d)` (a nested dict; fields left out take their defaults) or through
`configs/convert.py`.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Mapping


def knob(default, doc: str, *, choices=None, ge=None, gt=None, le=None, lt=None, note: str = ""):
  """A run-config field: `default`, a one-line `doc`, and the values it allows: one of `choices`,
  or a number within the bounds given (ge: >=, gt: >, le: <=, lt: <). `note` is added to the
  error message of a value below `ge`."""
  meta = dict(doc=doc, choices=None if choices is None else tuple(choices), ge=ge, gt=gt, le=le,
              lt=lt, note=note)
  return dataclasses.field(default=default, metadata=meta)


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # trace_jax.models.lora.TARGETS


@dataclasses.dataclass(frozen=True)
class LoraSection:
  """The run config's `model.lora` section (trace_jax/models/lora.py)."""
  rank: int = knob(0, "LoRA rank of the RL update (0: full fine-tuning). > 0: the base (the "
                   "checkpoint, or the warm start, which trains every weight) stays frozen in "
                   "model.param_dtype; adapters A, B and their Adam moments are f32", ge=0)
  alpha: float = knob(16.0, "LoRA scale numerator: W + (alpha / rank) A B", gt=0)
  targets: str = knob("q,k,v,o,gate,up,down", "comma-separated projections given adapters "
                      f"(any of {', '.join(LORA_TARGETS)}; or all)")
  dropout: float = knob(0.0, "dropout on the adapters' input; only 0 is supported (the update "
                        "takes no rng: resume stays exact)", ge=0)
  sampler: str = knob("merged", "the sampler's weights: merged (W + (alpha / rank) A B formed "
                      "once per step; decode costs what the base's does) | unmerged (base and "
                      "adapters, the low-rank product in every matmul; no second copy of the "
                      "weights)", choices=("merged", "unmerged"))


@dataclasses.dataclass(frozen=True)
class ModelSection:
  """The run config's `model` section."""
  preset: str = knob("tiny", "model preset when no checkpoint path is given (tiny, qwen3_0p6b ... "
                     "qwen3_14b)")
  path: str = knob("", "local HF checkpoint directory (config.json + safetensors)")
  tokenizer_path: str = knob("", "local tokenizer directory (default: model.path)")
  dtype: str = knob("float32", "compute dtype", choices=('float32', 'bfloat16', 'float16'))
  param_dtype: str = knob("float32", "dtype of the stored parameters (f32 masters and moments are "
                          "kept for bf16)", choices=('float32', 'bfloat16', 'float16'))
  hidden_size: int = knob(128, "tiny model: hidden width (ignored with a checkpoint or another "
                          "preset)", ge=1)
  num_layers: int = knob(3, "tiny model: decoder layers (ignored with a checkpoint or another "
                         "preset)", ge=1)
  intermediate_size: int = knob(384, "tiny model: MLP width (ignored with a checkpoint or another "
                                "preset)", ge=1)
  predictor_hidden: int = knob(128, "width of the success predictor's MLP", ge=1)
  predictor_features: str = knob("last", "What the head reads at a prefix: \"last\" (the final "
                                 "state at its last token) or \"last+prompt_mean\" (and the mean "
                                 "final state over the prompt; "
                                 "projects/mhqa/results/feature_probe.json)",
                                 choices=('last', 'last+prompt_mean'))
  lora: LoraSection = dataclasses.field(default_factory=LoraSection)


SFT_TRACES = ("expert", "oracle")  # the warm start imitates the imperfect expert, or the oracle
# envs.worlds.synthetic_world (two trap relations), envs.worlds.lessons_world
WORLD_KINDS = ("traps", "lessons")


@dataclasses.dataclass(frozen=True)
class WorldSection:
  """The run config's `world` section."""
  seed: int = knob(0, "seed of the synthetic world (entities, relations, questions); part of its "
                   "cache key")
  cache_dir: str = knob("cache", "where the world, tokenizer and warm-start checkpoint are cached")
  trap_rate: float = knob(0.7, "P(the expert queries a trap hop with the question's wording, "
                          "which surfaces the misleading passage). Higher: the better wording is "
                          "rarer in the traces, so RL must discover it.", ge=0, le=1)
  kind: str = knob("traps", "traps: the embedded world (two trap relations, one rule to learn); "
                   "lessons: K independent lessons with long-tailed frequency "
                   "(trace_jax/envs/worlds/lessons_world.py; the `lessons` variant).",
                   choices=WORLD_KINDS)
  n_relations: int = knob(32, "lessons world: K lessons, each a relation with its own verbs (the "
                          "shape: trace_jax/envs/worlds/lessons_world.py; "
                          "projects/lessons/README.md, world v4)")
  n_wordings: int = knob(2, "lessons world: query verbs per lesson relation, the fact verb and W "
                         "- 1 decoys", ge=2, note='(a fact verb and at least one decoy)')
  n_plain_relations: int = knob(4, "lessons world: relations with nothing to learn (one verb, no "
                                "decoy)")
  one_lesson_per_question: bool = knob(True, "lessons world: one lesson hop per question, the "
                                       "others plain")
  zipf_exponent: float = knob(1.0, "lessons world: lesson frequency in training 1 / rank^s", ge=0)
  expert_rate_lo: float = knob(0.003, "lessons world: the expert's fact-verb rate per lesson is "
                               "evenly spaced over [lo, hi] (or its logarithm), paired with "
                               "lessons independently of frequency")
  expert_rate_hi: float = knob(0.9, "lessons world: the upper end of those expert rates")
  expert_rate_spacing: str = knob("log", "lessons world: linear | log spacing of those expert "
                                  "rates", choices=('linear', 'log'))
  n_test: int = knob(512, "lessons world: held-out questions", ge=1)
  balanced_test: bool = knob(True, "lessons world: n_test / K held-out questions per lesson")


@dataclasses.dataclass(frozen=True)
class DataSection:
  """The run config's `data` section."""
  train_path: str = knob("", "local file in any supported format (trace_jax.data.load_qa)")
  test_path: str = knob("", "local held-out file, any supported format (trace_jax.data.load_qa)")
  format: str = knob("", "format of the data files ('' = detect from the file)")
  eval_size: int = knob(256, "held-out prompts evaluated (real data; greedy)", ge=1)
  train_hops: str = knob("", "e.g. \"3,4\": train only on questions with these hop counts ('' = "
                         "all; held-out evaluation keeps every hop count)")


@dataclasses.dataclass(frozen=True)
class RetrieverSection:
  """The run config's `retriever` section."""
  kind: str = knob("world", "world (BM25 over the synthetic passages) | bm25 | http",
                   choices=('world', 'bm25', 'http'))
  index_path: str = knob("", "bm25: a saved index directory or a Search-R1 jsonl corpus")
  url: str = knob("", "http: a Search-R1 compatible /retrieve server")
  topk: int = knob(2, "passages per search", ge=1)
  timeout_s: float = knob(10.0, "http: a hung server costs a search batch at most about timeout_s "
                          "* (retries + 1) plus the backoff sleeps (backoff_s, doubling, capped "
                          "at max_backoff_s); 4xx answers are not retried.", gt=0)
  retries: int = knob(2, "http: retries of a failed or timed-out request (4xx answers are not "
                      "retried)", ge=0)
  backoff_s: float = knob(0.5, "http: first sleep between retries, doubling each time", ge=0)
  max_backoff_s: float = knob(4.0, "http: cap of the sleep between retries", ge=0)
  batch_size: int = knob(64, "queries per request", ge=1)
  concurrency: int = knob(1, "requests in flight per search batch", ge=1)
  health_check: bool = knob(True, "GET /health before the first step: a dead URL fails at once")


@dataclasses.dataclass(frozen=True)
class EnvSection:
  """The run config's `env` section."""
  reward: str = knob("em", "em | f1 | em_format", choices=('em', 'f1', 'em_format'))
  max_turns: int = knob(5, "turns per trajectory (tool calls and the answer)", ge=1)
  max_turn_tokens: int = knob(24, "generated tokens per turn", ge=1)
  max_obs_tokens: int = knob(72, "observation tokens (cut in token space, closing tag kept)", ge=4)
  max_obs_bytes: int = knob(16384, "observation bytes (passages cut fairly; 0 = no cap)")
  max_seq_len: int = knob(384, "tokens of a whole trajectory (prompt, turns and observations)")


@dataclasses.dataclass(frozen=True)
class SftSection:
  """The run config's `sft` section."""
  num_traces: int = knob(24000, "expert traces the warm start trains on", ge=1)
  steps: int = knob(500, "warm-start optimizer steps (copying entities out of observations "
                    "appears after ~250)", ge=0)
  batch_rows: int = knob(24, "packed rows per step", ge=1)
  row_len: int = knob(320, "tokens per packed row (longer than any expert trace)", ge=1)
  lr: float = knob(3e-3, "warm-start peak learning rate (cosine decay after warmup)", gt=0)
  warmup: int = knob(50, "warm-start linear warmup steps", ge=0)
  min_lr_ratio: float = knob(0.05, "warm-start final learning rate as a share of the peak",
                             ge=0, le=1)
  seed: int = knob(-1, "warm-start seed (part of its cache key); -1: the run's seed")
  traces: str = knob("expert", "expert (its planted mistakes) | oracle (no mistakes: a capacity "
                     "check of the model, launch/world_check.py)", choices=SFT_TRACES)


@dataclasses.dataclass(frozen=True)
class RolloutSection:
  """The run config's `rollout` section."""
  prompts_per_step: int = knob(16, "prompts given rollouts per RL step", ge=1)
  candidate_prompts: int = knob(48, "trace/trace_tree/root_only: prompts scored by p̂ per step, "
                                "of which prompts_per_step get rollouts (> prompts_per_step = "
                                "pool)", ge=0)
  root_budget: int = knob(96, "M_root: stage-1 rollouts over the step's prompts", ge=1)
  min_per_prompt: int = knob(2, "stage 1: fewest rollouts a chosen prompt gets", ge=1)
  max_per_prompt: int = knob(12, "stage 1: most rollouts a prompt gets")
  prefix_budget: int = knob(32, "stage-2 continuations (in rollouts)", ge=0)
  max_per_anchor: int = knob(4, "stage 2: most continuations from one anchor", ge=1)
  budget_unit: str = knob("rollouts", "rollouts | tokens (prefix allocation per expected cost)",
                          choices=('rollouts', 'tokens'))
  tree_lambda: float = knob(0.01, "weight of extra contrast in already-mixed trees (trace_tree)",
                            ge=0)
  blend_prior: float = knob(0.0, "Beta-posterior blending strength of p̂ with outcomes (0 = off)",
                            ge=0)
  anchor_posterior: bool = knob(True, "stage 2: anchor success from a Beta posterior of the "
                                "tree's stage-1 outcomes and p̂(root), shifted by p̂(h) - "
                                "p̂(root)")
  anchor_prior_strength: float = knob(4.0, "s of that posterior's prior Beta(s p̂, s (1 - p̂))",
                                      gt=0)
  root_anchors: bool = knob(True, "stage 2 may draw fresh rollouts into unmixed trees at the root")
  cost_aware: bool = knob(True, "budget_unit=tokens: rank anchors by gain per expected token")
  explore_prompts: int = knob(0, "of prompts_per_step: pool prompts drawn at random, allocated as "
                              "if p̂ = 0.5 (predicted roots; 0 = the head picks them all)", ge=0)
  hard_prompts: int = knob(0, "of prompts_per_step: the pool's lowest-p̂ prompts, allocated as if "
                           "p̂ = 0.5 (a discovery term; predicted roots; 0 = off)", ge=0)
  metric_slice: int = knob(8, "random pool prompts per step measuring p̂ (outside the budget)",
                           ge=0)
  metric_rollouts: int = knob(2, "rollouts per measured prompt (not trained on)", ge=0)
  calibrate: str = knob("none", "none | platt: stage 1 recalibrates p̂ on the slice's outcomes",
                        choices=('none', 'platt'))
  calibrate_window: int = knob(8, "steps of slice outcomes in that fit", ge=1)
  calibrate_prior: float = knob(10.0, "pseudo-pairs of evidence for the identity map", ge=0)
  dapo_oversample: float = knob(1.5, "dapo: prompts sampled per kept prompt", ge=1)
  arpo_entropy_top: float = knob(0.25, "arpo: share of candidate anchors with highest entropy",
                                 gt=0, le=1)
  temperature: float = knob(0.8, "sampling temperature of RL rollouts (> 0; at 1.0 the tiny "
                            "policy's tail over entity names sinks most rollouts)")
  top_p: float = knob(1.0, "nucleus sampling mass (1 = off)", gt=0, le=1)
  top_k: int = knob(0, "sample among the k most likely tokens (0 = off)", ge=0)
  num_slots: int = knob(64, "sampler slots decoding at once (a multiple of data x fsdp)", ge=1)
  page_size: int = knob(16, "tokens per KV page", ge=1)
  num_pages: int = knob(8192, "KV pages (trees keep theirs until released)", ge=2)
  prefill_chunk: int = knob(64, "largest prefill chunk in tokens (chunks are bucketed from 32 up)",
                            ge=1)
  tree_attention: bool = knob(True, "decode with the tree (cascade) attention kernel (siblings "
                              "read shared prefix pages once)")
  root_objective: str = knob("paper", "Stage 1's value of m rollouts on a prompt: paper = "
                             "V_root(p̂, m) = 1 - p̂^m - (1 - p̂)^m; posterior = E[V_root] under "
                             "p ~ Beta(κ p̂, κ (1 - p̂)); discovery = posterior + β x the "
                             "expected information (nats) m rollouts give about p. κ: the head "
                             "ensemble's when rl.predictor_ensemble > 1 (moment-matched), else "
                             "root_concentration. binned = the posterior's value with the Beta "
                             "read off outcomes: the stage-1 trees of the last binned_window "
                             "steps, cut into binned_bins quantile bins of p̂, give each bin a "
                             "mean and a spread of true rates (a p̂ of 0.5 among prompts that "
                             "always or never succeed is worth little); the paper objective until "
                             "a step has run.")
  root_concentration: float = knob(8.0, "κ of p ~ Beta(κ p̂, κ (1 - p̂)) without a head ensemble",
                                   gt=0)
  discovery_beta: float = knob(0.5, "root_objective=discovery: weight β of the information gain "
                               "(nats)", ge=0)
  anchors: str = knob("all", "all | before_tool_call (stage-2 anchors only before a tool call)",
                      choices=('all', 'before_tool_call'))
  stage2: str = knob("batch", "batch | stream: a tree's continuations start when its own stage-1 "
                     "rollouts end, in the slots stage 1's tail leaves idle",
                     choices=('batch', 'stream'))
  stage2_deadline: float = knob(0.0, "stream: at most this share of stage-1 trees still running, "
                                "the budget left is spent (0: by the last tree to finish)",
                                ge=0, lt=1)
  keep_pool_kv: bool = knob(True, "the candidate pool's scoring prefill keeps its K/V pages for "
                            "the prompts then sampled (each prompt prefilled once a step)")
  off_policy_steps: int = knob(0, "1: the next step's stage-1 rollouts start in the slots this "
                               "step's tail leaves idle, under this step's weights, and finish "
                               "under the next ones (their log-probs are what they were sampled "
                               "with; `staleness` per step). Not on steps that end in an "
                               "evaluation or a checkpoint, so every checkpoint resumes exactly. "
                               "0: every step samples with its own weights only.", choices=(0, 1))
  decode_steps: int = knob(8, "Decode steps per device call: the host acts (stop checks, tool "
                           "calls, refills) once per call, so a slot whose turn ends inside a "
                           "call idles until the call ends (`ledger_empty_slot_steps` and "
                           "bench_step's split). Fewer: busier slots, more host round trips.", ge=1)
  binned_bins: int = knob(8, "root_objective=binned: quantile bins of p̂", ge=1)
  binned_window: int = knob(8, "root_objective=binned: steps of stage-1 trees the bins are read "
                            "from", ge=1)


@dataclasses.dataclass(frozen=True)
class RLSection:
  """The run config's `rl` section."""
  steps: int = knob(30, "RL steps (0: the warm start and the first evaluation only)",
                    ge=0, note='(0 runs the warm start and the first evaluation only)')
  lr: float = knob(2e-4, "policy learning rate", gt=0)
  predictor_lr: float = knob(3e-3, "success predictor head's learning rate", gt=0)
  advantage: str = knob("tree_contrastive", "tree_contrastive | grpo | tree_grpo | treerl",
                        choices=('tree_contrastive', 'grpo', 'tree_grpo', 'treerl'))
  normalize_std: bool = knob(True, "divide advantages by the tree's reward std (off: "
                             "Dr.GRPO-style)")
  eps_low: float = knob(0.2, "PPO clip below the ratio 1", ge=0)
  eps_high: float = knob(0.28, "PPO clip above the ratio 1 (clip-higher)", ge=0)
  kl_coef: float = knob(0.0, "weight of the k3 KL to the warm start (0 = off)", ge=0)
  entropy_coef: float = knob(0.0, "weight of the entropy bonus (0 = off)", ge=0)
  max_grad_norm: float = knob(1.0, "global gradient norm clip", gt=0)
  micro_batches: int = knob(4, "gradient accumulation micro-batches per optimizer step", ge=1)
  train_rows: int = knob(80, "packed rows of env.max_seq_len tokens per update (fixed shape)", ge=1)
  predictor_warmup_steps: int = knob(0, "steps before p̂ drives allocation (uniform before)", ge=0)
  predictor_fit_steps: int = knob(50, "extra full-batch predictor steps per RL step (0 = off)",
                                  ge=0)
  predictor_buffer_steps: int = knob(4, "RL steps of node examples kept for that fit", ge=1)
  predictor_root_buffer_steps: int = knob(4, "roots (one per prompt) may be kept longer", ge=1)
  predictor_refresh_roots: bool = knob(False, "re-featurize buffered roots under the current "
                                       "policy")
  predictor_leaf_weight: float = knob(0.0, "weight of leaves in the predictor fit (never queried)",
                                      ge=0)
  remat: str = knob("none", "per-layer rematerialization in the update: none | full | dots",
                    choices=('none', 'full', 'dots'))
  predictor_weighting: str = knob("visits", "uniform | visits (node weight n_y: roots weigh most)",
                                  choices=('uniform', 'visits'))
  predictor_warm_steps: int = knob(300, "predictor steps on the warm-start probe before RL", ge=0)
  max_consecutive_skips: int = knob(3, "stop (Diverged, exit 70) after this many RL steps' worth "
                                    "of skipped updates in a row", ge=1)
  max_param_growth: float = knob(100.0, "stop when the parameter norm exceeds this x its "
                                 "warm-start norm", gt=0)
  tree_values: str = knob("children", "V at branch points: children (unbiased under forks) | "
                          "leaves")
  ppo_epochs: int = knob(2, "passes over the step's rollouts (2 x 2 minibatches: +0.03 EM over 1 "
                         "x 1 for GRPO and TRACE alike; projects/mhqa/results/estimates)", ge=1)
  minibatches: int = knob(2, "optimizer steps per pass (rows split evenly)", ge=1)
  predictor_slice: bool = knob(False, "fit the head on the random slice's trees too")
  predictor_holdout: float = knob(0.0, "share of prompts held out of the fit for early stopping",
                                  ge=0, lt=1)
  predictor_ensemble: int = knob(1, "heads in the fit (bootstrap); > 1 gives p̂ an uncertainty",
                                 ge=1)
  packing: str = knob("tree", "update layout: tree (shared prefixes computed once) | none (one "
                      "row segment per leaf, every prefix once per leaf)")
  pack_row_len: int = knob(0, "tree packing's row length (0: env.max_seq_len); longer rows keep "
                           "bigger trees whole at a row's squared attention cost")
  attention: str = knob("dense", "the update's attention over packed rows: dense ([T, T] mask per "
                        "row) | blocked (only the key blocks a query block can see, listed on the "
                        "host; same result, cost follows the tree)", choices=("dense", "blocked"))


@dataclasses.dataclass(frozen=True)
class EvalSection:
  """The run config's `eval` section."""
  every: int = knob(10, "RL steps between held-out evaluations (greedy)", ge=1)
  size: int = knob(300, "held-out questions evaluated (synthetic worlds)",
                   ge=1, note='(an empty evaluation set has no accuracy)')
  probe_prompts: int = knob(32, "train prompts x 8 samples probing the warm start (prefix signal)",
                            ge=1)
  stop_on_collapse: bool = knob(True, "stop when held-out EM falls to 0 from a positive start")


@dataclasses.dataclass(frozen=True)
class CkptSection:
  """The run config's `ckpt` section."""
  every: int = knob(10, "RL steps between checkpoints", ge=1)
  max_to_keep: int = knob(2, "checkpoints kept", ge=1)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything a run reads. `method` is a name in `trace_jax.allocation.strategies`' registry."""
  variant: str = knob("tiny", "the config file's variant (`--config=configs/mhqa.py:VARIANT`)")
  task: str = knob("mhqa", "a registered task (`trace_jax.tasks`): mhqa (search) | math (a "
                   "calculator) | fc (function calling) | one of your own")
  method: str = knob("trace_tree", "a registered strategy: trace_tree (tree-aware), trace "
                     "(paper), root_only, grpo, dapo, tree_grpo, arpo")
  seed: int = knob(0, "the run's seed (prompt order, every rng stream; the warm start's unless "
                   "sft.seed is set)")
  workdir: str = knob("", "the run's directory (default: "
                      "runs/<variant>-<method>-seed<seed>-<time>)")
  mesh: str = knob("data:-1,fsdp:1,tensor:1", "mesh axes; -1 takes the remaining devices")
  model: ModelSection = dataclasses.field(default_factory=ModelSection)
  world: WorldSection = dataclasses.field(default_factory=WorldSection)
  data: DataSection = dataclasses.field(default_factory=DataSection)
  retriever: RetrieverSection = dataclasses.field(default_factory=RetrieverSection)
  env: EnvSection = dataclasses.field(default_factory=EnvSection)
  sft: SftSection = dataclasses.field(default_factory=SftSection)
  rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
  rl: RLSection = dataclasses.field(default_factory=RLSection)
  eval: EvalSection = dataclasses.field(default_factory=EvalSection)
  ckpt: CkptSection = dataclasses.field(default_factory=CkptSection)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  def replace(self, **changes) -> "TrainConfig":
    """A copy with top-level fields or whole sections changed (`dataclasses.replace`)."""
    return dataclasses.replace(self, **changes)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "TrainConfig":
    """Builds the config from a nested mapping of the dataclasses' fields; a field left out takes
    its default, each value given is checked against its field's type (an int is accepted for a
    float). Raises ValueError naming the first unknown or mistyped field."""
    return _build(cls, d, "")


_SCALARS = {"int": int, "float": float, "bool": bool, "str": str}


def _build(cls, d: Mapping[str, Any], where: str):
  if not hasattr(d, "keys"):
    raise ValueError(f"config{where}: expected a section, got {d!r}")
  fields = {f.name: f for f in dataclasses.fields(cls)}
  hints = typing.get_type_hints(cls)
  unknown = sorted(set(d.keys()) - set(fields))
  if unknown:
    raise ValueError(f"config{where}: unknown field(s) {unknown}; known: {sorted(fields)}")
  out = {}
  for name in fields:
    if name not in d:
      continue  # its default
    t, v, path = hints[name], d[name], f"{where}.{name}"
    if dataclasses.is_dataclass(t):
      out[name] = _build(t, v, path)
    else:
      out[name] = _scalar(t, v, path)
  return cls(**out)


def _scalar(t, v, path: str):
  name = t.__name__
  ok = {"bool": isinstance(v, bool),
        "int": isinstance(v, int) and not isinstance(v, bool),
        "float": isinstance(v, (int, float)) and not isinstance(v, bool),
        "str": isinstance(v, str)}[name]
  if not ok:
    raise ValueError(f"config{path}={v!r}: expected {name}")
  return float(v) if name == "float" else v


# ---- what the definitions give: checks and a reference ----------------------------------------
def knobs(cls=None, prefix: str = "") -> list[tuple[str, str, Any, dict]]:
  """Every knob of `cls` (default `TrainConfig`), sections walked: (dotted name, type name,
  default, metadata) in definition order."""
  cls = cls or TrainConfig
  hints = typing.get_type_hints(cls)
  out = []
  for f in dataclasses.fields(cls):
    t = hints[f.name]
    if dataclasses.is_dataclass(t):
      out += knobs(t, f"{prefix}{f.name}.")
    else:
      out.append((f"{prefix}{f.name}", t.__name__, f.default, dict(f.metadata)))
  return out


def knob_error(name: str, v, meta: Mapping[str, Any]) -> str | None:
  """Why value `v` of knob `name` is not allowed by its definition (`meta`), or None."""
  choices = meta.get("choices")
  if choices is not None:
    return None if v in choices else f"{name}={v!r}; choose one of {choices}"
  ge, gt, le, lt = (meta.get(k) for k in ("ge", "gt", "le", "lt"))
  if all(b is None for b in (ge, gt, le, lt)):
    return None
  if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
    return f"{name}={v!r} must be a finite number"
  ok = ((ge is None or v >= ge) and (gt is None or v > gt) and (le is None or v <= le)
        and (lt is None or v < lt))
  if ok:
    return None
  if le is None and lt is None:
    if gt is not None:
      return f"{name}={v!r} must be a finite number > {gt}"
    note = meta.get("note") or ""
    return f"{name}={v!r} must be >= {ge}" + (f" {note}" if note else "")
  lo = f"[{ge}" if ge is not None else (f"({gt}" if gt is not None else "(-inf")
  hi = f"{le}]" if le is not None else (f"{lt})" if lt is not None else "inf)")
  return f"{name}={v} must be in {lo}, {hi}"


def check_knobs(c: "TrainConfig") -> None:
  """Checks every field of `c` against its own definition (choices, bounds); raises ValueError
  naming the first field out of range. Checks that relate several fields are
  `configs/convert.py`'s."""
  d = c.to_dict()
  for name, _, _, meta in knobs():
    v = d
    for k in name.split("."):
      v = v[k]
    err = knob_error(name, v, meta)
    if err:
      raise ValueError(err)


def knob_table(section: str) -> str:
  """The markdown reference of one section's knobs (or "" for the top-level fields): name, default,
  allowed values, doc. `configs/README.md` holds every section's."""
  rows = ["| knob | default | allowed | what it does |", "|---|---|---|---|"]
  for name, _, default, meta in knobs():
    sec = name.split(".")[0] if "." in name else ""
    if sec != section:
      continue
    allowed = ""
    if meta.get("choices") is not None:
      allowed = " \\| ".join(str(x) for x in meta["choices"])
    else:
      parts = [f"{op} {meta[k]}" for k, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
               if meta.get(k) is not None]
      allowed = ", ".join(parts)
    doc = meta["doc"].replace("|", "\\|")
    rows.append(f"| `{name}` | `{default!r}` | {allowed} | {doc} |")
  return "\n".join(rows)


# ---- the parts' own configs, read from a run's --------------------------------------------------
def sampler_config(c: TrainConfig, **overrides):
  """The sampler engine's settings (`SamplerConfig`) of run config `c`: its rollout and env
  sections; `overrides` replace any of them."""
  from trace_jax.sampling.config import SamplerConfig

  r = c.rollout
  kw = dict(num_slots=r.num_slots, page_size=r.page_size, num_pages=r.num_pages,
            max_seq_len=c.env.max_seq_len, max_turn_tokens=c.env.max_turn_tokens,
            max_obs_tokens=c.env.max_obs_tokens, max_turns=c.env.max_turns,
            prefill_chunk=(32, r.prefill_chunk), temperature=r.temperature, top_p=r.top_p,
            top_k=r.top_k, use_tree_attention=r.tree_attention, seed=c.seed,
            decode_steps=r.decode_steps,
            prompt_mean_features=c.model.predictor_features == "last+prompt_mean")
  return SamplerConfig(**{**kw, **overrides})


def update_config(c: TrainConfig, **overrides):
  """The update step's settings (`UpdateConfig`) of run config `c`: its rl and model sections.
  Log-probs are the sampling policy's, softmax(z / T), as the sampler records them."""
  from trace_jax.rl.update import UpdateConfig

  kw = dict(lr=c.rl.lr, predictor_lr=c.rl.predictor_lr, eps_low=c.rl.eps_low,
            eps_high=c.rl.eps_high, kl_coef=c.rl.kl_coef, entropy_coef=c.rl.entropy_coef,
            max_grad_norm=c.rl.max_grad_norm, micro_batches=c.rl.micro_batches,
            remat=c.rl.remat, param_dtype=c.model.param_dtype,
            temperature=c.rollout.temperature,
            prompt_mean_features=c.model.predictor_features == "last+prompt_mean")
  return UpdateConfig(**{**kw, **overrides})


__all__ = ["check_knobs", "CkptSection", "DataSection", "EnvSection", "EvalSection", "knob",
           "knob_error", "knob_table", "knobs", "LoraSection", "ModelSection",
           "RetrieverSection", "RLSection", "RolloutSection", "sampler_config", "SftSection",
           "TrainConfig", "update_config", "WorldSection"]
