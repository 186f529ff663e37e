"""Multi-hop QA with TRACE. `--config=configs/mhqa.py[:variant]`.

Variants:
  tiny (default)  the embedded synthetic multi-hop world, tiny Qwen3, runs on a laptop CPU
  lessons         the many-lessons world (`envs/worlds/lessons_world.py`; projects/lessons)
  smoke           the same loop at toy size (a few steps), used by CI
  qwen3_8b        paper-style run with a local Qwen3-8B checkpoint and local data
  qwen3_14b       paper scale (Qwen3-14B); model, data and retriever paths are required
  real_smoke      the qwen3 path at toy size (CI: tests/test_real_path.py); paths as for qwen3_*
Overrides: `--config.rl.steps=50 --config.method=grpo`.
"""

from configs.base import DEFAULT_TRAP_RATE, apply_smoke, base_config, validate

__all__ = ["DEFAULT_TRAP_RATE", "get_config", "validate"]


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
  c = base_config()
  c.variant = variant
  if variant == "tiny":
    pass
  elif variant == "lessons":
    c.world.kind = "lessons"
    c.eval.size = 512            # every held-out question: EM per lesson needs them all
    c.rl.steps = 200             # lessons are found over a long run (launch/world_check.py)
  elif variant in ("smoke", "real_smoke"):
    apply_smoke(c)
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
    # The worst case of a step (every rollout at max_seq_len, trees held to the step's end) on
    # the v5p-64 mesh below: 6272 pages per data shard for 8B, 12544 for 14B (`python
    # launch/plan.py --pages`, results/kv_pages.md); 8192 pages did not hold 8B's largest tree.
    c.rollout.num_pages = 51200
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
