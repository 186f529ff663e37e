"""Prints a tool-task run's greedy held-out rollouts from its warm start, a few per template:
where the function-calling record's "what the samples showed" comes from.

  python projects/tool_tasks/show_samples.py --config=configs/fc.py --per_template=2

Builds the config's run (its warm start trained, or restored from `world.cache_dir`), samples
the first `--prompts` held-out problems greedily, and prints each template's first
`--per_template` rollouts with their reward. `--run=WORKDIR [--step=N]` samples that training
run's checkpointed policy instead, built from the run's own config.json (`--config` is then
not read). The attempts v1-v3 of the record were read with this at their own commits (each
commit's warm start).
"""

import os

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", os.path.join(_ROOT, "configs", "fc.py"),
                                          "configs/<task>.py[:variant]")
_PROMPTS = flags.DEFINE_integer("prompts", 40, "held-out problems sampled")
_PER = flags.DEFINE_integer("per_template", 2, "rollouts printed per template")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/show_samples", "the run's scratch workdir")
_RUN = flags.DEFINE_string("run", "", "a training run's workdir: sample its checkpoint's policy "
                           "(the latest, or --step) instead of the warm start")
_STEP = flags.DEFINE_integer("step", None, "the checkpoint step of --run")


def main(argv):
  del argv
  from configs import convert, runs
  from trace_jax import train as T
  from trace_jax.evaluate import evaluate

  if _RUN.value:  # the run's own config, in a scratch workdir (the run's is only read)
    from trace_jax.config import TrainConfig

    d = runs.load_run_config_dict(_RUN.value)
    d["workdir"] = _WORKDIR.value
    cfg = TrainConfig.from_dict(d)
  else:
    c = _CONFIG.value
    c.workdir = _WORKDIR.value
    cfg = convert.to_train_config(c)
  run = T.build(cfg)
  params = T.policy_params(run.init_params, cfg.model.param_dtype)
  if _RUN.value:
    from trace_jax.checkpoint import restore_run_policy, run_checkpoint_step

    step = run_checkpoint_step(_RUN.value, _STEP.value)
    params, step = restore_run_policy(cfg, _RUN.value, step, run.graphdef, run.init_params)
    print(f"policy of {_RUN.value} at step {step}")
  run.engine.update_params(params)
  examples = run.assets.test[:_PROMPTS.value]
  res = evaluate(run.engine, examples, batch=len(examples), keep_trees=True)
  shown = {}
  for e, tree in zip(examples, res["trees"]):
    group = (e.get("groups") or ["?"])[0]
    if shown.get(group, 0) >= _PER.value:
      continue
    shown[group] = shown.get(group, 0) + 1
    leaf = tree.leaves()[0]
    text = run.assets.decode(tree.path_tokens(leaf.id)[0][len(e["prompt_ids"]):])
    print(f"== {group} reward {leaf.reward} | {e['question']}\n{text}\n")


if __name__ == "__main__":
  app.run(main)
