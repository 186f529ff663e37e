"""Multi-hop QA with TRACE. `--config=configs/mhqa.py[:variant]`.

Variants:
  tiny (default)  the embedded synthetic multi-hop world, tiny Qwen3, runs on a laptop CPU
  lessons         the many-lessons world (`trace_jax/envs/lessons_world.py`; projects/lessons)
  smoke           the same loop at toy size (a few steps), used by CI
  qwen3_8b        paper-style run with a local Qwen3-8B checkpoint and local data
  qwen3_14b       paper scale (Qwen3-14B); model, data and retriever paths are required
  real_smoke      the qwen3 path at toy size (CI: tests/test_real_path.py); paths as for qwen3_*
Overrides: `--config.rl.steps=50 --config.method=grpo`.
"""

import os
import sys

import ml_collections

DEFAULT_TRAP_RATE = 0.7  # SyntheticWorldConfig.trap_rate: the world of every earlier result


def _base():
  c = ml_collections.ConfigDict()
  c.variant = "tiny"
  c.task = "mhqa"           # mhqa (search) | math (a calculator; configs/math.py)
  c.method = "trace_tree"   # a registered strategy: trace_tree (tree-aware), trace (paper),
  #                           grpo, ...
  c.seed = 0
  c.workdir = ""            # default: runs/<variant>-<method>-seed<seed>-<time>
  c.mesh = "data:-1,fsdp:1,tensor:1"  # mesh axes; -1 takes the remaining devices

  c.model = ml_collections.ConfigDict()
  c.model.preset = "tiny"   # Qwen3 preset when no checkpoint path is given
  c.model.path = ""         # local HF checkpoint directory (config.json + safetensors)
  c.model.tokenizer_path = ""  # local tokenizer directory (default: model.path)
  c.model.dtype = "float32"  # compute dtype
  c.model.param_dtype = "float32"
  c.model.hidden_size = 128  # tiny-model overrides (ignored with a checkpoint)
  c.model.num_layers = 3
  c.model.intermediate_size = 384
  c.model.predictor_hidden = 128  # width of the success predictor's MLP
  # What the head reads at a prefix: "last" (the final state at its last token) or
  # "last+prompt_mean" (and the mean final state over the prompt;
  # projects/mhqa/results/feature_probe.json)
  c.model.predictor_features = "last"

  c.world = ml_collections.ConfigDict()   # the synthetic world (ignored with real data)
  c.world.seed = 0
  c.world.cache_dir = "cache"   # world, tokenizer and warm-start checkpoint are cached here
  # P(the expert queries a trap hop with the question's wording, which surfaces the misleading
  # passage). Higher: the better wording is rarer in the traces, so RL must discover it.
  c.world.trap_rate = DEFAULT_TRAP_RATE
  # traps: the embedded world (two trap relations, one rule to learn); lessons: K independent
  # lessons with long-tailed frequency (trace_jax/envs/lessons_world.py; the `lessons` variant).
  c.world.kind = "traps"
  # The lessons world's shape (trace_jax/envs/lessons_world.py; projects/lessons/README.md says
  # why these values: world v4).
  c.world.n_relations = 32      # K lessons, each a relation with its own verbs
  c.world.n_wordings = 2        # query verbs per lesson relation: the fact verb and W - 1 decoys
  c.world.n_plain_relations = 4  # relations with nothing to learn (one verb, no decoy)
  c.world.one_lesson_per_question = True  # one lesson hop per question, the others plain
  c.world.zipf_exponent = 1.0   # lesson frequency in training 1 / rank^s
  c.world.expert_rate_lo = 0.003  # the expert's fact-verb rate per lesson: evenly spaced over
  c.world.expert_rate_hi = 0.9    # [lo, hi] (or its logarithm), paired with lessons
  c.world.expert_rate_spacing = "log"  # independently of frequency
  c.world.n_test = 512          # held-out questions ...
  c.world.balanced_test = True  # ... n_test / K per lesson

  c.data = ml_collections.ConfigDict()    # real data (qwen3 variants)
  c.data.train_path = ""    # local file in any supported format (trace_jax.data.load_qa)
  c.data.test_path = ""
  c.data.format = ""        # '' = detect
  c.data.eval_size = 256    # held-out prompts evaluated (greedy)
  c.data.train_hops = ""    # e.g. "3,4": train only on questions with these hop counts ('' = all;
  #                           held-out evaluation keeps every hop count)

  c.retriever = ml_collections.ConfigDict()
  c.retriever.kind = "world"  # world (BM25 over the synthetic passages) | bm25 | http
  c.retriever.index_path = ""  # bm25: a saved index directory or a Search-R1 jsonl corpus
  c.retriever.url = ""      # http: a Search-R1 compatible /retrieve server
  c.retriever.topk = 2      # passages per search
  # http: a hung server costs a search batch at most about timeout_s * (retries + 1) plus the
  # backoff sleeps (backoff_s, doubling, capped at max_backoff_s); 4xx answers are not retried.
  c.retriever.timeout_s = 10.0
  c.retriever.retries = 2
  c.retriever.backoff_s = 0.5
  c.retriever.max_backoff_s = 4.0
  c.retriever.batch_size = 64    # queries per request
  c.retriever.concurrency = 1    # requests in flight per search batch
  c.retriever.health_check = True  # GET /health before the first step: a dead URL fails at once

  c.env = ml_collections.ConfigDict()
  c.env.reward = "em"       # em | f1 | em_format
  c.env.max_turns = 5
  c.env.max_turn_tokens = 24   # generated tokens per turn
  c.env.max_obs_tokens = 72    # observation tokens (cut in token space, closing tag kept)
  c.env.max_obs_bytes = 16384  # observation bytes (passages cut fairly; 0 = no cap)
  c.env.max_seq_len = 384      # whole trajectory

  c.sft = ml_collections.ConfigDict()     # warm start on expert traces (synthetic world)
  c.sft.num_traces = 24000
  c.sft.steps = 500          # copying entities out of observations appears after ~250 steps
  c.sft.batch_rows = 24      # packed rows per step
  c.sft.row_len = 320        # tokens per packed row (longer than any expert trace)
  c.sft.lr = 3e-3
  c.sft.warmup = 50
  c.sft.min_lr_ratio = 0.05
  c.sft.seed = -1            # warm-start seed (part of its cache key); -1: the run's seed
  c.sft.traces = "expert"    # expert (its planted mistakes) | oracle (no mistakes: a capacity
  #                            check of the model, launch/world_check.py)

  c.rollout = ml_collections.ConfigDict()
  c.rollout.prompts_per_step = 16
  c.rollout.candidate_prompts = 48  # trace/trace_tree/root_only: prompts scored by p̂ per step, of
  #                                   which prompts_per_step get rollouts
  #                                   (> prompts_per_step = pool)
  c.rollout.root_budget = 96      # M_root: stage-1 rollouts over the step's prompts
  c.rollout.min_per_prompt = 2
  c.rollout.max_per_prompt = 12
  c.rollout.prefix_budget = 32    # stage-2 continuations (in rollouts)
  c.rollout.max_per_anchor = 4
  c.rollout.budget_unit = "rollouts"  # rollouts | tokens (prefix allocation per expected cost)
  c.rollout.tree_lambda = 0.01    # weight of extra contrast in already-mixed trees (trace_tree)
  c.rollout.blend_prior = 0.0     # Beta-posterior blending strength of p̂ with outcomes (0 = off)
  c.rollout.anchor_posterior = True  # stage 2: anchor success from a Beta posterior of the tree's
  #                                     stage-1 outcomes and p̂(root), shifted by p̂(h) - p̂(root)
  c.rollout.anchor_prior_strength = 4.0  # s of that posterior's prior Beta(s p̂, s (1 - p̂))
  c.rollout.root_anchors = True   # stage 2 may draw fresh rollouts into unmixed trees at the root
  c.rollout.cost_aware = True     # budget_unit=tokens: rank anchors by gain per expected token
  c.rollout.explore_prompts = 0   # of prompts_per_step: pool prompts drawn at random, allocated
  #                                 as if p̂ = 0.5 (predicted roots; 0 = the head picks them all)
  c.rollout.hard_prompts = 0      # of prompts_per_step: the pool's lowest-p̂ prompts, allocated
  #                                 as if p̂ = 0.5 (a discovery term; predicted roots; 0 = off)
  c.rollout.metric_slice = 8      # random pool prompts per step measuring p̂ (outside the budget)
  c.rollout.metric_rollouts = 2   # rollouts per measured prompt (not trained on)
  c.rollout.calibrate = "none"    # none | platt: stage 1 recalibrates p̂ on the slice's outcomes
  c.rollout.calibrate_window = 8  # steps of slice outcomes in that fit
  c.rollout.calibrate_prior = 10.0  # pseudo-pairs of evidence for the identity map
  c.rollout.dapo_oversample = 1.5  # dapo: prompts sampled per kept prompt
  c.rollout.arpo_entropy_top = 0.25  # arpo: share of candidate anchors with highest entropy
  c.rollout.temperature = 0.8     # at 1.0 the tiny policy's tail over entity names sinks
  #                                 most rollouts
  c.rollout.top_p = 1.0
  c.rollout.top_k = 0
  c.rollout.num_slots = 64
  c.rollout.page_size = 16
  c.rollout.num_pages = 8192       # KV pages (trees keep theirs until released)
  c.rollout.prefill_chunk = 64
  c.rollout.tree_attention = True
  # Stage 1's value of m rollouts on a prompt: paper = V_root(p̂, m) = 1 - p̂^m - (1 - p̂)^m;
  # posterior = E[V_root] under p ~ Beta(κ p̂, κ (1 - p̂)); discovery = posterior + β x the expected
  # information (nats) m rollouts give about p. κ: the head ensemble's when rl.predictor_ensemble
  # > 1 (moment-matched), else root_concentration. binned = the posterior's value with the Beta
  # read off outcomes: the stage-1 trees of the last binned_window steps, cut into binned_bins
  # quantile bins of p̂, give each bin a mean and a spread of true rates (a p̂ of 0.5 among prompts
  # that always or never succeed is worth little); the paper objective until a step has run.
  c.rollout.root_objective = "paper"
  c.rollout.binned_bins = 8
  c.rollout.binned_window = 8
  c.rollout.root_concentration = 8.0
  c.rollout.discovery_beta = 0.5
  c.rollout.anchors = "all"       # all | before_tool_call (stage-2 anchors only before a tool call)
  c.rollout.stage2 = "batch"      # batch | stream: a tree's continuations start when its own
  #                                 stage-1 rollouts end, in the slots stage 1's tail leaves idle
  c.rollout.keep_pool_kv = True   # the candidate pool's scoring prefill keeps its K/V pages for
  #                                  the prompts then sampled (each prompt prefilled once a step)
  c.rollout.stage2_deadline = 0.0  # stream: at most this share of stage-1 trees still running,
  #                                  the budget left is spent (0: by the last tree to finish)
  # 1: the next step's stage-1 rollouts start in the slots this step's tail leaves idle, under
  # this step's weights, and finish under the next ones (their log-probs are what they were
  # sampled with; `staleness` per step). Not on steps that end in an evaluation or a checkpoint,
  # so every checkpoint resumes exactly. 0: every step samples with its own weights only.
  c.rollout.off_policy_steps = 0
  # Decode steps per device call: the host acts (stop checks, tool calls, refills) once per call,
  # so a slot whose turn ends inside a call idles until the call ends (`ledger_empty_slot_steps`
  # and bench_step's split). Fewer: busier slots, more host round trips.
  c.rollout.decode_steps = 8

  c.rl = ml_collections.ConfigDict()
  c.rl.steps = 30
  c.rl.lr = 2e-4
  c.rl.predictor_lr = 3e-3
  c.rl.advantage = "tree_contrastive"  # tree_contrastive | grpo | tree_grpo | treerl
  c.rl.normalize_std = True
  c.rl.eps_low = 0.2
  c.rl.eps_high = 0.28
  c.rl.kl_coef = 0.0
  c.rl.entropy_coef = 0.0
  c.rl.max_grad_norm = 1.0
  c.rl.micro_batches = 4
  c.rl.train_rows = 80         # packed rows of env.max_seq_len tokens per update (fixed shape)
  c.rl.predictor_warmup_steps = 0  # steps before p̂ drives allocation (uniform before)
  c.rl.predictor_fit_steps = 50    # extra full-batch predictor steps per RL step (0 = off)
  c.rl.predictor_buffer_steps = 4  # RL steps of node examples kept for that fit
  c.rl.predictor_root_buffer_steps = 4  # roots (one per prompt) may be kept longer
  c.rl.predictor_refresh_roots = False  # re-featurize buffered roots under the current policy
  c.rl.predictor_leaf_weight = 0.0  # weight of leaves in the predictor fit (never queried)
  c.rl.remat = "none"          # per-layer rematerialization in the update: none | full | dots
  c.rl.predictor_weighting = "visits"  # uniform | visits (node weight n_y: roots weigh most)
  c.rl.predictor_warm_steps = 300  # predictor steps on the warm-start probe before RL
  c.rl.max_consecutive_skips = 3   # stop (Diverged, exit 70) after this many RL steps' worth
  #                                  of skipped updates in a row
  c.rl.tree_values = "children"   # V at branch points: children (unbiased under forks) | leaves
  c.rl.ppo_epochs = 2              # passes over the step's rollouts (2 x 2: +0.03 EM over the
  c.rl.minibatches = 2             # run for GRPO and TRACE alike; projects/mhqa/results/estimates)
  #                                  optimizer steps per pass (rows split evenly)
  c.rl.predictor_slice = False     # fit the head on the random slice's trees too
  c.rl.predictor_holdout = 0.0     # share of prompts held out of the fit for early stopping
  c.rl.predictor_ensemble = 1      # heads in the fit (bootstrap); > 1 gives p̂ an uncertainty
  c.rl.packing = "tree"            # update layout: tree (shared prefixes computed once) | none
  #                                  (one row segment per leaf, every prefix once per leaf)
  c.rl.pack_row_len = 0            # tree packing's row length (0: env.max_seq_len); longer rows
  #                                  keep bigger trees whole at a row's squared attention cost
  c.rl.max_param_growth = 100.0    # stop when the parameter norm exceeds this x its warm-start norm

  c.eval = ml_collections.ConfigDict()
  c.eval.every = 10
  c.eval.size = 300
  c.eval.probe_prompts = 32  # train prompts x 8 samples probing the warm start (prefix signal)
  c.eval.stop_on_collapse = True  # stop when held-out EM falls to 0 from a positive start

  c.ckpt = ml_collections.ConfigDict()
  c.ckpt.every = 10
  c.ckpt.max_to_keep = 2
  return c


def _real_smoke(c) -> None:
  """The qwen3 code path at toy size (CI), on top of the smoke settings: a local HF checkpoint and
  tokenizer, Search-R1 data and a retrieval server, all given on the command line (model.path,
  data.*, retriever.url). Only what differs from the smoke variant is set here."""
  c.model.dtype = "bfloat16"
  c.model.param_dtype = "bfloat16"
  c.model.predictor_hidden = 32
  c.retriever.kind = "http"
  c.retriever.topk = 1
  c.retriever.timeout_s = 5.0
  c.env.max_turns = 2
  c.env.max_turn_tokens = 12
  c.env.max_obs_tokens = 32
  c.env.max_seq_len = 256
  c.rollout.prompts_per_step = 2
  c.rollout.candidate_prompts = 2
  c.rollout.root_budget = 4
  c.rollout.prefix_budget = 2
  c.rollout.max_per_prompt = 4
  c.rollout.metric_slice = 0
  c.rollout.num_slots = 4      # the smoke pool of 1024 pages holds a tree per data x fsdp shard
  c.rl.lr = 1e-6
  c.rl.micro_batches = 2
  c.rl.train_rows = 4
  c.rl.kl_coef = 0.001
  c.rl.entropy_coef = 0.01     # a gradient even when a random policy earns no reward
  c.rl.remat = "dots"
  c.rl.predictor_fit_steps = 5
  c.eval.size = 4


def get_config(arg: str | None = None):
  variant = arg or "tiny"
  c = _base()
  c.variant = variant
  if variant == "tiny":
    pass
  elif variant == "lessons":
    c.world.kind = "lessons"
    c.eval.size = 512            # every held-out question: EM per lesson needs them all
    c.rl.steps = 200             # lessons are found over a long run (launch/world_check.py)
  elif variant in ("smoke", "real_smoke"):
    c.world.cache_dir = "cache/smoke"
    c.sft.num_traces = 600
    c.sft.steps = 8
    c.sft.batch_rows = 4
    c.sft.row_len = 256
    c.rollout.prompts_per_step = 4
    c.rollout.candidate_prompts = 6
    c.rollout.root_budget = 12
    c.rollout.prefix_budget = 6
    c.rollout.num_slots = 8
    c.rollout.num_pages = 1024
    c.rl.steps = 2
    c.rl.micro_batches = 1
    c.rl.train_rows = 12
    c.rl.predictor_warmup_steps = 0
    c.eval.every = 2
    c.eval.size = 8
    c.eval.probe_prompts = 4
    c.ckpt.every = 1
    if variant == "real_smoke":
      _real_smoke(c)
  elif variant in ("qwen3_8b", "qwen3_14b"):
    c.model.preset = variant
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "bfloat16"
    c.retriever.kind = "http"
    c.retriever.topk = 3
    c.env.max_turns = 4
    c.env.max_turn_tokens = 512
    c.env.max_obs_tokens = 512
    c.env.max_seq_len = 4096
    c.rollout.prompts_per_step = 64
    c.rollout.candidate_prompts = 64
    c.rollout.root_budget = 512
    c.rollout.min_per_prompt = 4
    c.rollout.max_per_prompt = 16
    c.rollout.prefix_budget = 256
    c.rollout.num_slots = 256
    c.rollout.page_size = 64
    c.rollout.num_pages = 8192
    c.rollout.prefill_chunk = 512
    c.rl.lr = 1e-6
    c.rl.steps = 200
    c.rl.micro_batches = 32
    c.rl.train_rows = 512
    c.rl.kl_coef = 0.001
    c.rl.remat = "dots"          # activations of a 4k-token row do not fit otherwise
    c.eval.every = 20
    # fsdp:4 puts params, masters and moments on 4x fewer copies: `python launch/plan.py
    # --config=configs/mhqa.py:qwen3_14b` (results/plan_qwen3.md) has 14B fitting v5p-64 only so.
    c.mesh = "data:-1,fsdp:4,tensor:8" if variant == "qwen3_14b" else "data:-1,fsdp:4,tensor:4"
  else:
    raise ValueError(f"unknown variant {variant!r}; choose tiny, lessons, smoke, qwen3_8b, "
                     f"qwen3_14b or real_smoke")
  return c


def tool_task_config(task: str, variant: str | None, *, max_turn_tokens: int, max_obs_tokens: int,
                     max_seq_len: int, eval_size: int, num_traces: int, sft_steps: int):
  """The base config of an embedded tool task (`configs/math.py`, `configs/fc.py`): `task`, its
  turn and sequence sizes, the expert's correct-method rates over [0.2, 0.7], and, in the tiny
  variant, its evaluation size and warm start (traces and SFT steps)."""
  variant = variant or "tiny"
  if variant not in ("tiny", "smoke"):
    raise ValueError(f"unknown variant {variant!r}; choose tiny or smoke")
  c = get_config(variant)
  c.task = task
  c.world.expert_rate_lo = 0.2
  c.world.expert_rate_hi = 0.7
  c.env.max_turns = 5          # up to three tool calls and the answer, one to spare
  c.env.max_turn_tokens = max_turn_tokens  # digits are one token each
  c.env.max_obs_tokens = max_obs_tokens
  c.env.max_seq_len = max_seq_len
  c.sft.row_len = max_seq_len
  if variant == "tiny":
    c.eval.size = eval_size
    c.sft.num_traces = num_traces
    c.sft.steps = sft_steps
  return c


def validate(c):
  """Checks every value of `c` (a ConfigDict of this file) and returns the run's typed
  `trace_jax.config.TrainConfig`; raises ValueError naming the first bad field. See
  `configs/convert.py`."""
  here = os.path.dirname(os.path.abspath(__file__))
  if here not in sys.path:
    sys.path.append(here)
  import convert

  return convert.to_train_config(c)
