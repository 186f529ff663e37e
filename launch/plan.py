"""Plans per-device memory of a config on one or more meshes, allocating nothing.

  python launch/plan.py --config=configs/mhqa.py:qwen3_14b --mesh=data:2,fsdp:4,tensor:8
  python launch/plan.py --config=configs/mhqa.py:qwen3_14b          # the candidate mesh table
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from trace_jax.models.qwen3 import get_preset  # noqa: E402
from trace_jax.plan import CANDIDATE_MESHES, DEVICE_GB, format_table, plan_memory  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/mhqa.py[:variant]")
_MESH = flags.DEFINE_string("mesh", None, "e.g. data:2,fsdp:4,tensor:8 (default: a table)")
_MICRO = flags.DEFINE_integer("micro_batch_seqs", 0, "sequences per micro-batch (default: "
                              "prompts_per_step x max_per_prompt / micro_batches)")


def main(argv):
  del argv
  c = _CONFIG.value
  if c is None:
    raise app.UsageError("--config is required, e.g. --config=configs/mhqa.py:qwen3_14b")
  cfg = get_preset(c.model.preset, dtype=c.model.dtype, param_dtype=c.model.param_dtype)
  seqs = _MICRO.value or max(
      1, (c.rollout.root_budget + c.rollout.prefix_budget) // c.rl.micro_batches)
  meshes = [_MESH.value] if _MESH.value else list(CANDIDATE_MESHES)
  plans = [plan_memory(cfg, m, num_pages=c.rollout.num_pages, page_size=c.rollout.page_size,
                       micro_batch_seqs=seqs, seq_len=c.env.max_seq_len) for m in meshes]
  print(f"{c.model.preset}: {plans[0].n_params / 1e9:.2f}B parameters ({c.model.param_dtype}), "
        f"AdamW moments f32, KV pool {c.rollout.num_pages} pages x {c.rollout.page_size} tokens, "
        f"micro-batch {seqs} x {c.env.max_seq_len} tokens, per-layer remat")
  print(format_table(plans))
  print(f"('fits' = total within 90% of a {', '.join(map(str, DEVICE_GB))} GB device)")


if __name__ == "__main__":
  app.run(main)
