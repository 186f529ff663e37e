"""The RL update on the same trees in both layouts: one row segment per leaf (`rl.packing=none`,
today's fixed `rl.train_rows` shape) and tree-packed (`rl.packing=tree`, shared prefixes once,
bucketed rows) (issue 28).

  python benchmarks/bench_update.py                  # default config's trees + the deep workload
  python benchmarks/bench_update.py --no_timing      # counts and memory only (a busy machine)

Workloads: `default_trace_tree` and `default_grpo` are the trees the default config samples
(`--batches` RL steps from its warm start, the update run between them); `deep_tree` is a
synthetic workload of the same node lengths where every tree has a first rollout of 4-5 turns and
8-12 leaves from stage-2 style forks after 2-3 turns. Layouts: `none` (today's), `none_bucketed`
(unpacked rows in the tree layout's row buckets: what shapes that follow the work give alone) and
`tree`. Per workload and layout: rows, token slots
(rows x row length) and the unique tokens they hold, the update step's wall time (median over
`--repeats` calls per batch, then over the batches; both layouts timed alternately in one process)
and its compiled memory (`memory_analysis()`: argument + output + temp - alias). Writes
results/update_bench.json:
  {"workloads": {"<name>": {"unpacked_s", "packed_s", "speedup", "unique_token_ratio",
   "slot_ratio", "proportionality", ...}}}
where unique_token_ratio = unique tokens / token slots computed (packed), slot_ratio = packed /
unpacked slots, proportionality = (packed_s / unpacked_s) / slot_ratio (1 = time proportional to
the slots computed; the target is within 1.25), and results/update_bench.png.

`deep_tree_whole` (issue 54) is the deep workload with whole trees per row of `--whole_row_len`
tokens, against every unpacked sequence (`none_all`: as many rows as they need, none dropped),
with the dense mask (`tree`) and with the block-sparse attention (`tree_blocked`,
`rl.attention=blocked`):
  python benchmarks/bench_update.py --workloads=deep_tree_whole --out=results/update_bench_blocked
gives unpacked_s, dense_s, blocked_s, speedup (unpacked / blocked), blocked_over_dense and
proportionality (of the blocked rows).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

_CONFIG = flags.DEFINE_string("config", "tiny", "variant of configs/mhqa.py")
_BATCHES = flags.DEFINE_integer("batches", 3, "RL steps of trees per sampled workload")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed update calls per batch and layout")
_DEEP_TREES = flags.DEFINE_integer("deep_trees", 16, "trees per deep-tree batch")
_NO_TIMING = flags.DEFINE_bool("no_timing", False, "counts and memory only")
_OUT = flags.DEFINE_string("out", "results/update_bench", "output stem")
_PACK_ROW_LEN = flags.DEFINE_integer("pack_row_len", 0, "rl.pack_row_len of the tree layout "
                                     "(0: env.max_seq_len)")
_WORKLOADS = flags.DEFINE_string("workloads", "default_trace_tree,default_grpo,deep_tree",
                                 "comma-separated workloads to run")
_WHOLE_ROW_LEN = flags.DEFINE_integer("whole_row_len", 1536, "rl.pack_row_len of deep_tree_whole "
                                      "(rows long enough to hold whole deep trees)")
_TREES_FROM = flags.DEFINE_string("trees_from", "", "read each method's sampled trees from "
                                  "<dir>/<method>/trees_<i>.jsonl (an earlier run's) instead of "
                                  "sampling them")


def sample_batches(method: str, variant: str, batches: int):
  """`batches` steps' trained trees of the default config with `method` (the update runs between
  them, so later steps sample from a moved policy), and the run that sampled them."""
  from configs import mhqa
  from trace_jax import train
  from trace_jax.sampling.tree import save_trees

  c = mhqa.get_config(variant)
  c.method = method
  c.workdir = f"/tmp/bench_update/{method}"
  c = mhqa.validate(c)
  run = train.build(c)
  if _TREES_FROM.value:
    from trace_jax.sampling.tree import load_trees
    return run, train.init_state(run), [
        load_trees(os.path.join(_TREES_FROM.value, method, f"trees_{i}.jsonl"))
        for i in range(batches)]
  state = train.probe_warm_start(run, train.init_state(run))
  out = []
  for i in range(batches):
    sample, rec = train.sample_step(run, state)
    out.append(list(sample.trees))
    save_trees(out[-1], os.path.join(c.workdir, f"trees_{i}.jsonl"))  # for a look afterwards
    state, _ = train.update_step(run, state, sample, rec)
  return run, state, out


def deep_trees(rng, n: int, lengths: dict, max_len: int, vocab: int):
  """Synthetic deep trees: node lengths drawn from `lengths` (prompt, gen, obs samples of a real
  workload); a first rollout of 4-5 turns, then forks from its nodes at depth 2-3 (and from the
  forks' own turns) until the tree has 8-12 leaves; paths kept within `max_len` tokens."""
  from trace_jax.sampling.tree import Tree

  def draw(k):
    return int(rng.choice(lengths[k]))

  def ids(k):
    return rng.integers(4, vocab, k).tolist()

  trees = []
  for uid in range(n):
    t = Tree(ids(draw("prompt")), uid=uid)
    plen = {0: len(t.prompt_ids)}

    def grow(parent, turns, serial):
      node = parent
      for d in range(turns):
        g, o = draw("gen"), draw("obs")
        last = d == turns - 1 or plen[node] + g + o + 40 > max_len
        o = 0 if last else o
        g = min(g, max_len - plen[node])
        child = t.add_node(node, gen_ids=ids(g), logprobs=(-rng.random(g)).tolist(),
                           obs_ids=ids(o), done=last, rollout=serial,
                           reward=float(rng.random() < 0.5) if last else None)
        plen[child.id] = plen[node] + g + o
        node = child.id
        if last:
          return

    grow(0, int(rng.integers(4, 6)), 0)
    want = int(rng.integers(8, 13))
    serial = 1
    while len(t.leaves()) < want:
      anchors = [nd.id for nd in t.nodes if not nd.done and nd.depth in (2, 3)]
      if not anchors:
        break
      a = int(rng.choice(anchors))
      grow(a, int(rng.integers(1, 4)), serial)
      serial += 1
    trees.append(t)
  return trees


def node_lengths(batches) -> dict:
  out = {"prompt": [], "gen": [], "obs": []}
  for trees in batches:
    for t in trees:
      out["prompt"].append(len(t.prompt_ids))
      for nd in t.nodes[1:]:
        out["gen"].append(len(nd.gen_ids))
        if not nd.done:
          out["obs"].append(len(nd.obs_ids))
  return {k: np.asarray(v or [1]) for k, v in out.items()}


def unique_tokens(trees, row_len: int) -> int:
  """Tokens of the nodes on finished leaves' paths, each once (cut at `row_len` along a path):
  the tree layout with one unbounded row."""
  from trace_jax.rl.batch import build_tree_units

  units, _, _ = build_tree_units(trees, "grpo", 8, row_len=1 << 40, max_nodes=1 << 40,
                                 cut_len=row_len)
  return sum(len(u["tokens"]) for u in units)


LAYOUTS = ("none", "none_bucketed", "tree")
# deep_tree_whole: every unpacked sequence (no row cap, nothing dropped), whole trees per long row
# with the dense mask, the same rows with the block-sparse attention (`rl.attention=blocked`).
WHOLE_LAYOUTS = ("none_all", "tree", "tree_blocked")


def layout_batches(run, batches, layouts=LAYOUTS, pack_row_len=None) -> dict:
  """Per layout, the (batch, info) of each batch of trees: `none` as the train loop packs it
  unpacked (today's fixed rows), `none_bucketed` unpacked in the tree layout's row buckets (the
  shapes-follow-the-work half of the gain alone), `none_all` unpacked in as many rows as its
  sequences need, `tree` as the train loop packs it and `tree_blocked` the same with
  `rl.attention=blocked`. Tree rows are `pack_row_len` long (default: the flag)."""
  from trace_jax import train
  from trace_jax.parallel.micro_batch import row_shards
  from trace_jax.rl.batch import pack_batch, row_buckets

  c = run.c
  row = _PACK_ROW_LEN.value if pack_row_len is None else pack_row_len
  multiple = (c.rl.micro_batches * c.rl.minibatches
              * row_shards(run.mesh if run.mesh.size > 1 else None))
  out = {k: [] for k in layouts}
  for trees in batches:
    for name in layouts:
      packing = "tree" if name.startswith("tree") else "none"
      attention = "blocked" if name == "tree_blocked" else "dense"
      cp = c.replace(rl=c.rl.__class__(**{**c.rl.__dict__, "packing": packing,
                                          "pack_row_len": row, "attention": attention}))
      units = train.training_units(cp, trees)
      if name == "none_all":
        out[name].append(pack_batch(units, c.env.max_seq_len, train.preds_per_row(cp),
                                    row_multiple=multiple))
      elif name == "none_bucketed":
        out[name].append(pack_batch(units, c.env.max_seq_len, train.preds_per_row(cp),
                                    buckets=row_buckets(train.update_rows(c, run.mesh),
                                                        multiple)))
      else:
        out[name].append(train.pack_rows(cp, run.mesh, units))
  return out


def measure(run, state, batches, repeats: int, timing: bool, layouts=LAYOUTS,
            pack_row_len=None) -> dict:
  import jax
  import jax.numpy as jnp

  c = run.c
  per = layout_batches(run, batches, layouts, pack_row_len)
  out = {}
  for name, items in per.items():
    rows = [info["padded_rows"] for _, info in items]
    length = items[0][0]["tokens"].shape[1]
    out[name] = dict(rows=float(np.median(rows)), row_len=length,
                     slots=float(np.median(rows)) * length,
                     tokens=float(np.median([info["tokens"] for _, info in items])),
                     dropped_sequences=float(sum(i["dropped_sequences"] for _, i in items)))
    if "attention_blocks" in items[0][1]:
      out[name]["attention_blocks"] = float(np.median([i["attention_blocks"] for _, i in items]))
    batch = max(items, key=lambda x: x[1]["padded_rows"])[0]
    m = run.update.lower(state.train, batch).compile().memory_analysis()
    out[name]["peak_bytes"] = float(m.argument_size_in_bytes + m.output_size_in_bytes
                                    + m.temp_size_in_bytes - m.alias_size_in_bytes)
  out["unique_tokens"] = float(np.median([unique_tokens(t, c.env.max_seq_len) for t in batches]))
  if timing:
    times = {k: [] for k in layouts}
    for i in range(len(batches)):
      for name in layouts:  # compile every shape first
        ts = jax.tree.map(jnp.copy, state.train)
        jax.block_until_ready(run.update(ts, per[name][i][0]))
      reps = {k: [] for k in layouts}
      for _ in range(repeats):
        for name in layouts:  # alternate, so load drifts hit every layout alike
          ts = jax.block_until_ready(jax.tree.map(jnp.copy, state.train))
          t0 = time.perf_counter()
          jax.block_until_ready(run.update(ts, per[name][i][0]))
          reps[name].append(time.perf_counter() - t0)
      for name in layouts:
        times[name].append(float(np.median(reps[name])))
    for name in layouts:
      out[name]["seconds"] = float(np.median(times[name]))
      out[name]["seconds_per_batch"] = times[name]
  return out


def summarize(m: dict) -> dict:
  u, b, p = m["none"], m["none_bucketed"], m["tree"]
  row = dict(unpacked_rows=u["rows"], unpacked_bucketed_rows=b["rows"], packed_rows=p["rows"],
             packed_row_len=p["row_len"],
             unpacked_slots=u["slots"], packed_slots=p["slots"], unpacked_tokens=u["tokens"],
             packed_tokens=p["tokens"], unique_tokens=m["unique_tokens"],
             unique_token_ratio=m["unique_tokens"] / p["slots"],
             unpacked_unique_token_ratio=m["unique_tokens"] / u["slots"],
             slot_ratio=p["slots"] / u["slots"],
             unpacked_peak_mb=u["peak_bytes"] / 2**20,
             unpacked_bucketed_peak_mb=b["peak_bytes"] / 2**20,
             packed_peak_mb=p["peak_bytes"] / 2**20,
             dropped_sequences_unpacked=u["dropped_sequences"],
             dropped_sequences_packed=p["dropped_sequences"])
  if "seconds" in u:
    row.update(unpacked_s=u["seconds"], unpacked_bucketed_s=b["seconds"], packed_s=p["seconds"],
               speedup=u["seconds"] / p["seconds"],
               speedup_over_bucketed=b["seconds"] / p["seconds"],
               proportionality=(p["seconds"] / u["seconds"]) / row["slot_ratio"],
               unpacked_s_per_batch=u["seconds_per_batch"],
               unpacked_bucketed_s_per_batch=b["seconds_per_batch"],
               packed_s_per_batch=p["seconds_per_batch"])
  return row


def summarize_whole(m: dict) -> dict:
  """deep_tree_whole: unpacked (every sequence) against whole-tree rows, dense and blocked.
  speedup = unpacked_s / blocked_s; proportionality = (blocked_s / unpacked_s) / slot_ratio as in
  `summarize`; dense_proportionality the same for the dense rows."""
  u, d, k = m["none_all"], m["tree"], m["tree_blocked"]
  row = dict(unpacked_rows=u["rows"], packed_rows=d["rows"], packed_row_len=d["row_len"],
             unpacked_slots=u["slots"], packed_slots=d["slots"], unpacked_tokens=u["tokens"],
             packed_tokens=d["tokens"], unique_tokens=m["unique_tokens"],
             unique_token_ratio=m["unique_tokens"] / d["slots"],
             slot_ratio=d["slots"] / u["slots"], attention_blocks=k.get("attention_blocks"),
             unpacked_peak_mb=u["peak_bytes"] / 2**20, dense_peak_mb=d["peak_bytes"] / 2**20,
             blocked_peak_mb=k["peak_bytes"] / 2**20,
             dropped_sequences=u["dropped_sequences"] + d["dropped_sequences"])
  if "seconds" in u:
    row.update(unpacked_s=u["seconds"], dense_s=d["seconds"], blocked_s=k["seconds"],
               speedup=u["seconds"] / k["seconds"], dense_speedup=u["seconds"] / d["seconds"],
               blocked_over_dense=d["seconds"] / k["seconds"],
               proportionality=(k["seconds"] / u["seconds"]) / row["slot_ratio"],
               dense_proportionality=(d["seconds"] / u["seconds"]) / row["slot_ratio"],
               unpacked_s_per_batch=u["seconds_per_batch"],
               dense_s_per_batch=d["seconds_per_batch"],
               blocked_s_per_batch=k["seconds_per_batch"])
  return row


def main(argv):
  del argv
  timing = not _NO_TIMING.value
  workloads, sampled = {}, {}
  run = state = None
  todo = _WORKLOADS.value.split(",")
  for method in ("trace_tree", "grpo"):
    deep = any(w.startswith("deep_tree") for w in todo)
    if f"default_{method}" not in todo and not (method == "trace_tree" and deep):
      continue
    run, state, batches = sample_batches(method, _CONFIG.value, _BATCHES.value)
    sampled[method] = batches
    if f"default_{method}" not in todo:
      continue
    workloads[f"default_{method}"] = summarize(measure(run, state, batches, _REPEATS.value,
                                                       timing))
    print(json.dumps({f"default_{method}": workloads[f"default_{method}"]}), flush=True)
  if not any(w.startswith("deep_tree") for w in todo):
    return finish(run, workloads, timing)
  rng = np.random.default_rng(0)
  lengths = node_lengths(sampled["trace_tree"])
  vocab = 1 + max(max(nd.gen_ids + nd.obs_ids, default=0) for b in sampled["trace_tree"]
                  for t in b for nd in t.nodes)  # token ids the model has sampled or read
  deep = [deep_trees(rng, _DEEP_TREES.value, lengths, run.c.env.max_seq_len, vocab)
          for _ in range(_BATCHES.value)]
  leaves = float(np.mean([len(t.leaves()) for b in deep for t in b]))
  if "deep_tree" in todo:
    workloads["deep_tree"] = summarize(measure(run, state, deep, _REPEATS.value, timing))
    workloads["deep_tree"]["leaves_per_tree"] = leaves
    print(json.dumps({"deep_tree": workloads["deep_tree"]}), flush=True)
  if "deep_tree_whole" in todo:
    workloads["deep_tree_whole"] = summarize_whole(measure(
        run, state, deep, _REPEATS.value, timing, WHOLE_LAYOUTS, _WHOLE_ROW_LEN.value))
    workloads["deep_tree_whole"]["leaves_per_tree"] = leaves
    print(json.dumps({"deep_tree_whole": workloads["deep_tree_whole"]}), flush=True)
  finish(run, workloads, timing)


def finish(run, workloads: dict, timing: bool):
  out = dict(command="python benchmarks/bench_update.py " + " ".join(sys.argv[1:]),
             machine=platform.processor() or platform.machine(), cpus=os.cpu_count(),
             config=_CONFIG.value, timing=timing, repeats=_REPEATS.value,
             row_len=run.c.env.max_seq_len, pack_row_len=_PACK_ROW_LEN.value,
             whole_row_len=_WHOLE_ROW_LEN.value,
             train_rows=run.c.rl.train_rows,
             targets=dict(default_trace_tree_speedup=1.6, default_grpo_speedup=1.3,
                          deep_tree_speedup=2.5, proportionality=1.25,
                          deep_tree_whole_speedup=2.5, deep_tree_whole_proportionality=1.1),
             workloads=workloads)
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  with open(_OUT.value + ".json", "w") as f:
    json.dump(out, f, indent=1)
  plotted = {k: w for k, w in workloads.items() if "unpacked_bucketed_rows" in w}
  if plotted:  # deep_tree_whole has its own three layouts: its numbers are in the json
    plot(plotted, _OUT.value + ".png", timing)


def plot(workloads: dict, path: str, timing: bool):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = list(workloads)
  x = np.arange(len(names))
  fig, axes = plt.subplots(1, 2 if timing else 1, figsize=(10 if timing else 5.5, 3.6),
                           squeeze=False)
  ax = axes[0, 0]
  rl = workloads[names[0]]["unpacked_slots"] / workloads[names[0]]["unpacked_rows"]
  ax.bar(x - 0.27, [workloads[n]["unpacked_slots"] for n in names], 0.27, label="unpacked")
  ax.bar(x, [workloads[n]["unpacked_bucketed_rows"] * rl for n in names], 0.27,
         label="unpacked, bucketed rows")
  ax.bar(x + 0.27, [workloads[n]["packed_slots"] for n in names], 0.27, label="tree-packed")
  ax.plot(x, [workloads[n]["unique_tokens"] for n in names], "k_", ms=30, mew=2,
          label="unique tokens")
  ax.set(xticks=x, xticklabels=names, title="token slots computed per update")
  ax.legend(fontsize=7, loc="lower left")
  if timing:
    ax = axes[0, 1]
    ax.bar(x - 0.27, [workloads[n]["unpacked_s"] for n in names], 0.27, label="unpacked")
    ax.bar(x, [workloads[n]["unpacked_bucketed_s"] for n in names], 0.27,
           label="unpacked, bucketed rows")
    ax.bar(x + 0.27, [workloads[n]["packed_s"] for n in names], 0.27, label="tree-packed")
    for i, n in enumerate(names):
      ax.text(i, max(workloads[n]["unpacked_s"], workloads[n]["packed_s"]),
              f"{workloads[n]['speedup']:.2f}x", ha="center", va="bottom", fontsize=9)
    ax.set(xticks=x, xticklabels=names, title="update step, seconds (median)",
           ylim=(0, 1.2 * max(workloads[n]["unpacked_s"] for n in names)))
    ax.legend(fontsize=7, loc="lower left")
  for a in axes.flat:
    a.tick_params(axis="x", labelsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


if __name__ == "__main__":
  app.run(main)
