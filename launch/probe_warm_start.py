"""Probes the cached warm start: is there contrast to learn from, and can the predictor see it?

  python launch/probe_warm_start.py --config=configs/mhqa.py

For each sampling temperature: the share of train prompts whose 8 samples are mixed, the sampled
success, and the success of rollouts after a trap-hop search that surfaced the needed passage vs a
planted misleading one. Then an offline fit of the predictor head on the prefix features of those
rollouts (70/30 split by prompt), to separate "the features carry no signal" from "online training
does not extract it". Writes results/warm_start_probe.json.
"""

import json
import logging
import os
import platform
import sys
import time

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "configs"))

from absl import app, flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", os.path.join(_ROOT, "configs", "mhqa.py"),
                                          "configs/mhqa.py[:variant]")
_PROMPTS = flags.DEFINE_integer("prompts", 256, "train prompts probed")
_TEMPS = flags.DEFINE_string("temperatures", "1.0,0.8", "sampling temperatures")
_OUT = flags.DEFINE_string("out", "results/warm_start_probe.json", "output JSON")


def main(argv):
  del argv
  import numpy as np
  from flax import nnx

  from trace_jax import assets as assets_lib
  from trace_jax.diagnostics import prefix_signal
  from trace_jax.envs.env import MultiHopEnv
  from trace_jax.evaluate import evaluate, sampling_mode
  from trace_jax.models.predictor import PredictorHead
  from trace_jax.rl.batch import tree_metrics
  from trace_jax.rl.predictor_fit import PredictorFitter, node_examples
  from trace_jax.rl.predictor_metrics import predictor_report
  from trace_jax.rl.update import UpdateConfig, make_optimizers
  from trace_jax.rollout.env_adapter import TreeEnvAdapter
  from trace_jax.rollout.sampler import PromptRequest, SamplerEngine
  from trace_jax.rollout.sampler_config import sampler_config_from

  logging.getLogger("bm25s").setLevel(logging.WARNING)
  absl_logging.set_verbosity(absl_logging.WARNING)
  c = _CONFIG.value
  assets = assets_lib.load_world_assets(c)
  graphdef, params = nnx.split(assets_lib.build_model(c, assets.vocab_size))
  params, ws = assets_lib.warm_start(c, assets, graphdef, params)
  env = MultiHopEnv(assets.retriever, c.env.reward, max_turns=c.env.max_turns,
                    topk=c.retriever.topk)
  scfg = sampler_config_from(c, num_pages=6 * c.rollout.num_pages)
  engine = SamplerEngine(graphdef, params, scfg, assets.encode, assets.decode,
                         TreeEnvAdapter(env, golds_key="answers"), assets.eos_id)
  rng = np.random.default_rng(c.seed)
  probe = [assets.train[i] for i in rng.choice(len(assets.train), _PROMPTS.value, replace=False)]
  out = dict(command="python launch/probe_warm_start.py " + " ".join(sys.argv[1:]),
             machine=dict(platform=platform.platform(), cpu_count=os.cpu_count()),
             date=time.strftime("%Y-%m-%d %H:%M:%S"), prompts=len(probe), samples_per_prompt=8,
             warm_start=dict(path=ws.get("path"), steps=ws.get("steps")), temperatures={})
  ev = evaluate(engine, assets.test[:c.eval.size])  # greedy, as the training run's step-0 eval
  out["greedy"] = dict(em=ev["em"], f1=ev["f1"], n=ev["n"], em_by_hops=ev["em_by_hops"])
  print("greedy", json.dumps(out["greedy"]), flush=True)
  for temp in map(float, _TEMPS.value.split(",")):
    with sampling_mode(engine, temperature=temp):
      trees = engine.run([PromptRequest(e["prompt_ids"], 8, meta=e) for e in probe])
    tm = tree_metrics(trees)
    res = dict(mixed_share=tm["effective_ratio"], sampled_success=tm["reward_mean"],
               **prefix_signal(trees, assets.world))
    if temp == c.rollout.temperature:  # offline predictor fit on this temperature's rollouts
      split = int(0.7 * len(trees))
      d_model = nnx.merge(graphdef, params).cfg.hidden_size
      head = PredictorHead(d_model, c.model.predictor_hidden, rngs=nnx.Rngs(c.seed + 1))
      hg, hs = nnx.split(head)
      tx = make_optimizers(UpdateConfig(predictor_lr=c.rl.predictor_lr))[1]
      fitter = PredictorFitter(hg, tx, steps=300, buffer_steps=1, max_rows=10**6)
      fitter.add(trees[:split])
      hs, _, info = fitter.fit(hs, tx.init(hs))
      x, y = node_examples(trees[split:])
      p = np.asarray(nnx.merge(hg, hs).prob(x))
      kinds = np.asarray([_kind(n) for t in trees[split:] for n in t.nodes
                          if n.feature is not None and n.value is not None])
      res["offline_predictor"] = dict(
          train_rows=info.get("predictor_fit_rows"), heldout=predictor_report(p, y > 0.5),
          # What allocation reads: roots (stage 1) and internal turn boundaries (stage 2).
          **{f"heldout_{k}": predictor_report(p[kinds == k], y[kinds == k] > 0.5)
             for k in ("root", "anchor")})
    out["temperatures"][str(temp)] = res
    engine.release(trees)
    print(temp, json.dumps(res, default=float), flush=True)
  os.makedirs(os.path.dirname(_OUT.value), exist_ok=True)
  with open(_OUT.value, "w") as f:
    json.dump(out, f, indent=1, default=float)


def _kind(node) -> str:
  if node.parent < 0:
    return "root"
  return "leaf" if node.done else "anchor"


if __name__ == "__main__":
  app.run(main)
