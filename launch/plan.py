"""Plans per-device memory of a config's RL loop on meshes and devices, allocating nothing.

  python launch/plan.py --config=configs/mhqa.py:qwen3_14b --mesh=data:4,fsdp:1,tensor:8
  python launch/plan.py --config=configs/mhqa.py:qwen3_14b   # Qwen3-8B and 14B on v5p-64, v5e-256
  python launch/plan.py --config=configs/mhqa.py:qwen3_14b --out=results/plan_qwen3.md
  python launch/plan.py --config=configs/mhqa.py:qwen3_14b --lora_rank=16 \
      --out=results/plan_lora.md   # 7-14B, full and LoRA, on v5e-8, v5p-8, one 80/141 GB GPU

The table takes the config's rollout (slots, KV pages, page size), env (sequence length) and rl
(rows, micro-batches, remat, kl_coef) sections and plans both Qwen3-8B and Qwen3-14B with them on
every (data, fsdp, tensor) split of the two slices; where no split fits, it searches the smallest
config change that does (see `trace_jax/plan.py` for the terms).
"""

import itertools
import math
import os

from absl import app, flags
from ml_collections import config_flags

from trace_jax.models.qwen3 import get_preset
from trace_jax.parallel.micro_batch import padded_rows
from trace_jax.parallel.sharding import parse_mesh_spec
from trace_jax.plan import (
  DEVICES,
  KV_POOL_LAYOUTS,
  SLICES,
  candidate_meshes,
  format_table,
  plan_memory,
)
from trace_jax.train import preds_per_row, row_len

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/mhqa.py[:variant]")
_MESH = flags.DEFINE_string("mesh", None, "one mesh, e.g. data:4,fsdp:1,tensor:8 (default: the "
                            "slice tables)")
_KV_POOL = flags.DEFINE_enum("kv_pool", "sharded", KV_POOL_LAYOUTS, "KV pool layout: sharded "
                             "(pages over data x fsdp, heads over tensor: the train loop's "
                             "sampler), main (heads over tensor only: an engine without a mesh), "
                             "replicated")
_OUT = flags.DEFINE_string("out", None, "also write the report (markdown) here")
_LORA = flags.DEFINE_integer("lora_rank", 0, "> 0: LoRA at this rank next to full fine-tuning "
                             "for the 7-14B presets on single hosts (results/plan_lora.md)")
_LORA_TARGETS = flags.DEFINE_string("lora_targets", "q,k,v,o,gate,up,down", "LoRA projections")
_PAGES = flags.DEFINE_bool("pages", False, "report every variant's worst-case KV pages per RL "
                           "step against its pool instead (results/kv_pages.md)")
# The devices (and mesh, where not the config's) each variant of configs/mhqa.py runs on: a CPU,
# CI's two processes of 4 devices on its test mesh, a v5p-64 (32 chips) for the paper-scale
# variants (the slice their memory plans fit).
VARIANT_DEVICES = {"tiny": (1, None), "lessons": (1, None), "smoke": (1, None),
                   "real_smoke": (8, "data:2,fsdp:2,tensor:2"), "qwen3_8b": (32, None),
                   "qwen3_14b": (32, None)}
_HEADROOM = 0.9  # a plan fits a device when its peak is within 90% of the device's memory


def _rows(train_rows: int, micro: int, dp: int, minibatches: int = 1) -> int:
  """The rows one compiled update sees, as the train loop pads them (`train.update_rows`): the
  packed batch is a multiple of micro_batches x minibatches x data x fsdp, padding rows counted
  at full cost, and each of `rl.minibatches` optimizer steps takes 1 / minibatches of it."""
  return padded_rows(train_rows, micro * minibatches, dp) // minibatches


def _settings(c, **over) -> dict:
  s = dict(num_pages=c.rollout.num_pages, page_size=c.rollout.page_size,
           num_slots=c.rollout.num_slots, seq_len=c.env.max_seq_len,
           train_rows=c.rl.train_rows, micro_batches=c.rl.micro_batches, remat=c.rl.remat,
           minibatches=c.rl.minibatches,
           kl_coef=c.rl.kl_coef, preds_per_row=preds_per_row(c), packing=c.rl.packing,
           update_seq_len=row_len(c),
           predictor_hidden=c.model.predictor_hidden, kv_pool=_KV_POOL.value)
  s.update(over)
  return s


def _plan(cfg, mesh: str, s: dict):
  sizes = parse_mesh_spec(mesh)
  dp = sizes["data"] * sizes["fsdp"]
  # Longer packed rows: as many token slots in fewer rows (`train.pack_rows`'s cap).
  useq = s.get("update_seq_len") or s["seq_len"]
  lora = {k: s[k] for k in ("lora_rank", "lora_targets", "lora_sampler") if k in s}
  return plan_memory(cfg, mesh, num_pages=s["num_pages"], page_size=s["page_size"], **lora,
                     seq_len=s["seq_len"], update_seq_len=useq,
                     rows=_rows(-(-s["train_rows"] * s["seq_len"] // useq), s["micro_batches"],
                                dp, s.get("minibatches", 1)),
                     micro_batches=s["micro_batches"], num_slots=s["num_slots"],
                     remat=s["remat"], kl_coef=s["kl_coef"], kv_pool=s["kv_pool"],
                     preds_per_row=s["preds_per_row"], predictor_hidden=s["predictor_hidden"],
                     packing=s.get("packing", "none"))


def _fits(p, gb: float) -> bool:
  return not p.error and p.total_gb <= gb * _HEADROOM


def _breakdown(p) -> list[str]:
  out = [f"  resident {p.resident_gb:.2f} GB: " +
         ", ".join(f"{k} {v:.2f}" for k, v in p.resident.items())]
  if p.error:
    out.append(f"  update: cannot run ({p.error})")
  else:
    out.append(f"  + update step {sum(p.update_extra.values()):.2f} GB: " +
               ", ".join(f"{k} {v:.2f}" for k, v in p.update_extra.items()))
  out.append(f"  + decode step {sum(p.decode_extra.values()):.2f} GB: " +
             ", ".join(f"{k} {v:.2f}" for k, v in p.decode_extra.items()))
  if not p.error:
    out.append(f"  peak {p.total_gb:.2f} GB (update {p.update_gb:.2f}, decode {p.decode_gb:.2f})")
  return out


# Config changes tried when no split of a slice fits the config as is: fewest changed fields first.
def _changes(s: dict, micro_options=(16, 8, 64, 128)):
  micro = [s["micro_batches"]] + [m for m in micro_options if m != s["micro_batches"]]
  pages = [s["num_pages"]] + [p for p in (4096, 2048) if p < s["num_pages"]]
  pools = [s["kv_pool"]] + [k for k in ("sharded",) if k != s["kv_pool"]]
  remats = [s["remat"]] + [r for r in ("full",) if r != s["remat"]]
  out = []
  for m, pg, pool, remat in itertools.product(micro, pages, pools, remats):
    out.append({k: v for k, v in dict(micro_batches=m, num_pages=pg, kv_pool=pool,
                                      remat=remat).items() if v != s[k]})
  return sorted(out, key=len)  # stable: within a count, the order above


def _search(cfg, c, n_dev: int, gb: float, meshes=None, micro_options=(16, 8, 64, 128),
            **settings):
  """The first change (in `_changes` order) under which some split fits, with the best split's
  plan (the lowest peak). meshes: the splits tried (default `candidate_meshes`); settings
  override the config's (`_settings`)."""
  s0 = _settings(c, **settings)
  closest = None  # (over, mesh, plan) with the lowest peak of all tried, when none fits
  for over in _changes(s0, micro_options):
    s = dict(s0, **over)
    best = None
    for mesh in meshes or candidate_meshes(n_dev, cfg.num_kv_heads):
      p = _plan(cfg, mesh, s)
      if p.error:
        continue
      if _fits(p, gb) and (best is None or p.total_gb < best[1].total_gb):
        best = (mesh, p)
      if closest is None or p.total_gb < closest[2].total_gb:
        closest = (over, mesh, p)
    if best:
      return over, best, None
  return None, None, closest


def _configured_mesh(c, n_dev: int) -> str:
  """The config's mesh (one axis may be -1) resolved on n_dev devices."""
  sizes = parse_mesh_spec(c.mesh)
  fixed = math.prod(v for v in sizes.values() if v != -1)
  sizes = {k: (n_dev // fixed if v == -1 else v) for k, v in sizes.items()}
  return ",".join(f"{k}:{v}" for k, v in sizes.items())


def _rows_and_trees(c, mesh: str, s: dict) -> str:
  """The update's padded rows and whether one KV pool shard holds one rollout alone (what
  `SamplerEngine.check_rollout_fits` checks when the run is built) on `mesh`."""
  sizes = parse_mesh_spec(mesh)
  dp = sizes["data"] * sizes["fsdp"]
  rows = _rows(s["train_rows"], s["micro_batches"], dp, s.get("minibatches", 1))
  shards = dp if s["kv_pool"] == "sharded" else 1
  need = -(-s["seq_len"] // s["page_size"]) + 1
  per_shard = s["num_pages"] // shards - 1
  mbs = s.get("minibatches", 1)
  pad = (f"{rows * mbs} update rows ({rows * mbs - s['train_rows']} of them padding)"
         + (f", {rows} per minibatch" if mbs > 1 else ""))
  if per_shard >= need:
    return f"{pad}; a pool shard holds {per_shard} pages, one rollout needs at most {need}"
  return (f"{pad}; a pool shard holds {per_shard} pages but one rollout may need {need}: the "
          f"run stops at build; raise num_pages to {(need + 1) * shards}")


def report(c) -> str:
  lines = []
  s = _settings(c)
  lines.append("# Per-device memory of the RL loop: Qwen3-8B and Qwen3-14B\n")
  lines.append(f"Config `{c.variant}`: {s['num_slots']} decode slots, KV pool {s['num_pages']} "
               f"pages x {s['page_size']} tokens (layout `{s['kv_pool']}`), sequences of "
               f"{s['seq_len']} tokens, update rows of {s['update_seq_len']} tokens "
               f"(packing `{s['packing']}`), train_rows {s['train_rows']}, micro_batches "
               f"{s['micro_batches']}, remat `{s['remat']}`, kl_coef {s['kl_coef']}, params "
               f"{c.model.param_dtype} with f32 masters and f32 AdamW moments. GB = 1e9 bytes; "
               f"'yes' = peak within {_HEADROOM:.0%} of the device's memory. Devices: " +
               ", ".join(f"{n} {g} GB" for n, g in DEVICES) + ". Slices: " +
               ", ".join(f"{k} = {n} chips of {g} GB" for k, (n, g) in SLICES.items()) + ".\n")
  lines.append("Columns: weights = masters + sampler copy + init copy + KL reference; optim = "
               "AdamW mu + nu; update+ / decode+ = what the update / decode step adds on top of "
               "the resident set; peak = resident + the larger step. The update's rows are "
               "train_rows padded to a multiple of micro_batches x data x fsdp, as the train "
               "loop pads them (`train.update_rows`); padding rows cost as much as real ones. "
               "n/a: the plan could not be made for that split.\n")
  summary = []
  for preset in ("qwen3_8b", "qwen3_14b"):
    cfg = get_preset(preset, dtype=c.model.dtype, param_dtype=c.model.param_dtype)
    for name, (n_dev, gb) in SLICES.items():
      meshes = candidate_meshes(n_dev, cfg.num_kv_heads)
      plans = [_plan(cfg, m, s) for m in meshes]
      lines.append(f"## {preset} on {name} ({n_dev} devices), config as is\n")
      lines.append("```\n" + format_table(plans) + "\n```\n")
      cm = _configured_mesh(c, n_dev)
      cp = _plan(cfg, cm, s)
      state = ("cannot run: " + cp.error if cp.error else
               f"peak {cp.total_gb:.1f} GB, {'fits' if _fits(cp, gb) else 'does NOT fit'}")
      summary.append(f"- {preset} on {name}, the config's own mesh `{c.mesh}` = {cm}: {state}; "
                     f"{_rows_and_trees(c, cm, s)}.")
      ok = [(m, p) for m, p in zip(meshes, plans) if _fits(p, gb)]
      if ok:
        m, p = min(ok, key=lambda mp: mp[1].total_gb)
        summary.append(f"- {preset} on {name}: fits with the rest of the config as is; best "
                       f"split {m} at {p.total_gb:.1f} GB of {gb} GB.")
        continue
      valid = [(m, p) for m, p in zip(meshes, plans) if not p.error]
      if valid:
        m, p = min(valid, key=lambda mp: mp[1].total_gb)
        why = [f"- {preset} on {name}: no split fits the config as is. Best split {m} needs "
               f"{p.total_gb:.1f} GB per device of {gb} GB x {_HEADROOM:.0%}:"]
        why += ["  " + x for x in _breakdown(p)]
      else:
        why = [f"- {preset} on {name}: cannot run as configured on any split: "
               f"{plans[0].error} (e.g. {meshes[0]}), and likewise on every other split."]
      over, best, closest = _search(cfg, c, n_dev, gb)
      if over is None:
        why.append("  No tried change (micro_batches 8 to 128, num_pages down to 2048, KV "
                   "pool sharded over data, remat full, together) makes it fit.")
        if closest:
          co, cm, cp = closest
          why.append(f"  Closest: {co} on mesh {cm}, peak {cp.total_gb:.2f} GB of "
                     f"{gb * _HEADROOM:.1f} usable:")
          why += ["  " + x for x in _breakdown(cp)]
      else:
        bm, bp = best
        why.append(f"  Fits with {over or 'the mesh change alone'} on mesh {bm}: peak "
                   f"{bp.total_gb:.1f} GB.")
        why += ["  " + x for x in _breakdown(bp)]
      summary += why
  lines.append("## Summary\n")
  lines += summary
  return "\n".join(lines) + "\n"


# Single hosts for `--lora`: name -> (devices, GB each).
HOSTS = {"v5e-8": (8, 16), "v5p-8": (4, 95), "1 GPU 80 GB": (1, 80), "1 GPU 141 GB": (1, 141)}
LORA_PRESETS = ("qwen3_8b", "qwen3_14b", "qwen2p5_7b", "llama3p1_8b")
# One host holds the config's rows in more micro-batches (down to one row per device each).
HOST_MICRO = (16, 8, 64, 128, 256, 512)


def host_meshes(n_dev: int, num_kv_heads: int) -> list[str]:
  """Every (data, fsdp, tensor) split of n_dev devices with tensor dividing the KV heads."""
  out = []
  for t in (1, 2, 4, 8):
    if n_dev % t or num_kv_heads % t:
      continue
    f = 1
    while f <= n_dev // t:
      if (n_dev // t) % f == 0:
        out.append(f"data:{n_dev // t // f},fsdp:{f},tensor:{t}")
      f *= 2
  return out


def _host_cell(cfg, c, n_dev, gb, **lora) -> tuple[str, str]:
  """(table cell, detail line) of one model on one host, full fine-tuning or LoRA."""
  meshes = host_meshes(n_dev, cfg.num_kv_heads)
  over, best, closest = _search(cfg, c, n_dev, gb, meshes=meshes, micro_options=HOST_MICRO,
                                **lora)
  if over is None:
    co, cm, cp = closest
    return (f"no ({cp.total_gb:.0f} GB)",
            f"does not fit; closest {cm} with {co or 'the config as is'}: peak "
            f"{cp.total_gb:.1f} GB of {gb * _HEADROOM:.0f} usable; " + _breakdown(cp)[0].strip())
  m, p = best
  return (f"yes ({p.total_gb:.0f} GB)",
          f"fits on {m} with {over or 'the config as is'}: peak {p.total_gb:.1f} GB "
          f"(update {p.update_gb:.1f}, decode {p.decode_gb:.1f})")


def lora_report(c, rank: int, targets: str) -> str:
  """LoRA next to full fine-tuning for the 7-14B presets on single hosts (`HOSTS`)."""
  s = _settings(c)
  lines = ["# Per-device memory: LoRA next to full fine-tuning on one host\n",
           f"`python launch/plan.py --config=configs/mhqa.py:{c.variant} --lora_rank={rank}`. "
           f"The config's settings (sequences of {s['seq_len']} tokens, {s['num_slots']} decode "
           f"slots, train_rows {s['train_rows']}, micro_batches {s['micro_batches']}, remat "
           f"`{s['remat']}`, kl_coef {s['kl_coef']}, params {c.model.param_dtype}); where they do "
           f"not fit, the first change that does (micro_batches 8 to 512, KV pages down to 2048, "
           f"remat full) on the best (data, fsdp, tensor) split. Full fine-tuning: f32 masters "
           f"and AdamW moments of every weight, the sampler's copy, the KL reference. LoRA rank "
           f"{rank} on `{targets}` (`model.lora`): the frozen base (also the KL reference), f32 "
           f"adapters and moments. 'yes' = peak within "
           f"{_HEADROOM:.0%} of the device's memory; GB = 1e9 bytes.\n",
           "Per host three columns: full fine-tuning, LoRA with the sampler's merged copy "
           "(`model.lora.sampler=merged`, the default), LoRA unmerged (no second copy of the "
           "weights where the mesh has no fsdp; decode does the low-rank products).\n",
           "| model | params | " + " | ".join(f"{h} full | LoRA | LoRA unmerged" for h in HOSTS)
           + " |", "|---|---|" + "---|---|---|" * len(HOSTS)]
  details = []
  from trace_jax.models import get_preset as any_preset  # every family's presets

  for preset in LORA_PRESETS:
    cfg = any_preset(preset, dtype=c.model.dtype, param_dtype=c.model.param_dtype)
    cells = []
    for host, (n_dev, gb) in HOSTS.items():
      for name, lora in (("full", {}),
                         ("LoRA", dict(lora_rank=rank, lora_targets=targets,
                                       lora_sampler="merged")),
                         ("LoRA unmerged", dict(lora_rank=rank, lora_targets=targets,
                                                lora_sampler="unmerged"))):
        cell, detail = _host_cell(cfg, c, n_dev, gb, **lora)
        cells.append(cell)
        details.append(f"- {preset}, {host}, {name}: {detail}")
    n = _plan(cfg, host_meshes(1, cfg.num_kv_heads)[0], s).n_params
    lines.append(f"| {preset} | {n / 1e9:.1f}B | " + " | ".join(cells) + " |")
  return "\n".join(lines + ["", "## Each cell\n"] + details) + "\n"


def pages_report() -> str:
  """Every variant's worst-case KV pages per RL step against its pool (`trace_jax.kv_demand`)."""
  from configs import mhqa
  from trace_jax.config import TrainConfig
  from trace_jax.kv_demand import format_demand, page_demand

  rows = []
  for variant, (devices, mesh) in VARIANT_DEVICES.items():
    c = TrainConfig.from_dict(mhqa.get_config(variant).to_dict())  # typed, paths not needed
    c = c.replace(mesh=mesh) if mesh else c
    rows.append((f"{variant} (`{c.mesh}`)", devices, page_demand(c, devices)))
  return ("Worst-case KV pages per RL step (`python launch/plan.py --pages`): every rollout of a "
          "step (root and prefix budgets, the measured slice) at env.max_seq_len, no prefix "
          "shared, trees spread whole over the data x fsdp shards; finished trees keep their "
          "pages cached until the step ends. A pool below the worst case evicts that cache, "
          "and below the working set (every decode slot of a shard at max_seq_len) preempts "
          "branches, recomputing their K/V when they resume; nothing is cut.\n\n"
          + format_demand(rows) + "\n")


def main(argv):
  del argv
  if _PAGES.value:
    text = pages_report()
    print(text)
    if _OUT.value:
      os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
      with open(_OUT.value, "w") as f:
        f.write(text)
    return
  if _CONFIG.value is None:
    raise app.UsageError("--config is required, e.g. --config=configs/mhqa.py:qwen3_14b")
  from trace_jax.config import TrainConfig

  # Typed, not validated: a plan needs no checkpoint or data paths.
  c = TrainConfig.from_dict(_CONFIG.value.to_dict())
  if _MESH.value:
    cfg = get_preset(c.model.preset, dtype=c.model.dtype, param_dtype=c.model.param_dtype)
    p = _plan(cfg, _MESH.value, _settings(c))
    print(f"{c.model.preset}: {p.n_params / 1e9:.2f}B parameters on {_MESH.value}")
    print(format_table([p]))
    print("\n".join(_breakdown(p)))
    return
  text = (lora_report(c, _LORA.value, _LORA_TARGETS.value)
          if _LORA.value > 0 else report(c))
  print(text)
  if _OUT.value:
    os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
    with open(_OUT.value, "w") as f:
      f.write(text)


if __name__ == "__main__":
  app.run(main)
