"""Does a rerun reproduce a committed campaign? Run by run, record by record.

  python launch/compare.py --methods=grpo,trace_tree --seeds=1 --regimes=default \
    --budgets=rollouts --set=rl.steps=12 --set=eval.every=2 --runs=runs/repro_early \
    --out=runs/repro_early/_out
  python projects/mhqa/repro_check.py --reference=projects/mhqa/results/compare_early \
    --rerun=runs/repro_early/_out \
    --out=projects/mhqa/results/repro_early

Both directories are `launch/compare.py` outputs (a `summary.json` and the archived runs under
`runs/<run>/metrics.jsonl.gz`). For every run of the rerun's summary that the reference also holds,
the per-step records are merged by step and compared key by key, leaving out wall-clock figures
(keys naming seconds or latency): which keys differ, the largest absolute difference of each, and
the keys only one side logs (metrics added between the two commits). The summary figures of the run
(final EM, effective ratio, generated tokens, mean EM over the run) are compared the same way.
Writes `<out>.json` and `<out>.md`; prints the Markdown.
"""

from __future__ import annotations

import json
import numbers
import os
import shlex
import sys

from absl import app, flags

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")

from launch.campaign import archived_metrics, archived_records, summary_rows  # noqa: E402

IGNORED = ("seconds", "latency", "wall")
SUMMARY_KEYS = ("accuracy_final", "effective_ratio", "generated_tokens", "rollouts",
                "em_curve_mean", "slice_auc")


def _kept(key: str) -> bool:
  return not any(t in key for t in IGNORED)


def by_step(recs: list[dict]) -> dict[int, dict]:
  """The records of one run merged per step (a step's eval record joins its train record)."""
  out: dict[int, dict] = {}
  for r in recs:
    if isinstance(r.get("step"), int):
      out.setdefault(r["step"], {}).update({k: v for k, v in r.items() if _kept(k)})
  return out


def _diff(a, b) -> float | None:
  """|a - b| for two numbers (0 when equal, inf when one is NaN and the other not); None when the
  values are not both numbers (compared for equality instead)."""
  num = lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool)
  if not (num(a) and num(b)):
    return None
  if a != a or b != b:  # NaN
    return 0.0 if (a != a and b != b) else float("inf")
  return abs(float(a) - float(b))


def compare_dicts(a: dict, b: dict) -> dict:
  """{key: largest |difference|} over the keys both hold that differ (a non-number that differs
  counts as inf), and the keys only one side holds."""
  differ = {}
  for k in sorted(set(a) & set(b)):
    d = _diff(a[k], b[k])
    if d is None:
      d = 0.0 if a[k] == b[k] else float("inf")
    if d > 0:
      differ[k] = d
  return dict(differ=differ, only_reference=sorted(set(a) - set(b)),
              only_rerun=sorted(set(b) - set(a)))


def compare_run(ref_recs: list[dict], new_recs: list[dict], ref_row: dict, new_row: dict) -> dict:
  """One run, reference against rerun: per-key largest difference over the shared steps, the
  steps only one side has, and the summary figures."""
  ra, rb = by_step(ref_recs), by_step(new_recs)
  differ: dict[str, float] = {}
  only_ref, only_new = set(), set()
  for step in sorted(set(ra) & set(rb)):
    c = compare_dicts(ra[step], rb[step])
    for k, d in c["differ"].items():
      differ[k] = max(differ.get(k, 0.0), d)
    only_ref |= set(c["only_reference"])
    only_new |= set(c["only_rerun"])
  summary = compare_dicts({k: ref_row.get(k) for k in SUMMARY_KEYS if k in ref_row},
                          {k: new_row.get(k) for k in SUMMARY_KEYS if k in new_row})
  shared = sorted(set(ra) & set(rb))
  return dict(steps_compared=len(shared), steps_only_reference=sorted(set(ra) - set(rb)),
              steps_only_rerun=sorted(set(rb) - set(ra)),
              keys_compared=len({k for s in shared for k in set(ra[s]) & set(rb[s])}),
              differ=differ, keys_only_reference=sorted(only_ref), keys_only_rerun=sorted(only_new),
              summary_differ=summary["differ"],
              identical=not differ and not summary["differ"] and bool(shared)
              and set(ra) == set(rb),
              reference={k: ref_row.get(k) for k in SUMMARY_KEYS},
              rerun={k: new_row.get(k) for k in SUMMARY_KEYS})


def _rows(out_dir: str) -> dict[tuple, dict]:
  return {(r["run"], r["budget"]): r for r in summary_rows(out_dir)}


def _records(out_dir: str, run: str) -> list[dict]:
  recs = archived_records(out_dir, run)
  if recs is None:
    raise SystemExit(f"{archived_metrics(out_dir, run)}: no archived records (summarize the "
                     "campaign with compare.py first)")
  return recs


def check(reference: str, rerun: str) -> list[dict]:
  """Every run of `rerun`'s summary that `reference` also holds, compared (see compare_run)."""
  ref, new = _rows(reference), _rows(rerun)
  both = sorted(set(ref) & set(new))
  if not both:
    raise SystemExit(f"no run of {rerun} is in {reference}")
  return [dict(run=run, budget=budget, **compare_run(_records(reference, run),
                                                     _records(rerun, run),
                                                     ref[(run, budget)], new[(run, budget)]))
          for run, budget in both]


def markdown(rows: list[dict]) -> str:
  lines = ["| run | budget | steps | keys | verdict | largest differences | "
           "final EM (ref / rerun) |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    worst = sorted({**r["differ"], **r["summary_differ"]}.items(), key=lambda kv: -kv[1])[:4]
    verdict = "identical" if r["identical"] else f"{len(r['differ'])} keys differ"
    lines.append(
        f"| {r['run']} | {r['budget']} | {r['steps_compared']} | {r['keys_compared']} | "
        f"{verdict} | "
        + (", ".join(f"{k} {d:.3g}" for k, d in worst) or "-")
        + f" | {r['reference'].get('accuracy_final')} / {r['rerun'].get('accuracy_final')} |")
  return "\n".join(lines) + "\n"


def main(argv):
  del argv
  rows = check(_REFERENCE.value, _RERUN.value)
  command = "python projects/mhqa/repro_check.py " + shlex.join(sys.argv[1:])
  md = markdown(rows)
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  with open(_OUT.value + ".json", "w") as f:
    json.dump(dict(command=command, reference=_REFERENCE.value, rerun=_RERUN.value,
                   ignored_key_parts=IGNORED, runs=rows), f, indent=1)
  with open(_OUT.value + ".md", "w") as f:
    f.write(f"Command:\n\n```sh\n{command}\n```\n\nPer-step records compared key by key (keys "
            f"naming {', '.join(IGNORED)} left out); keys only one side logs are listed in the "
            "JSON.\n\n" + md)
  print(md, flush=True)


if __name__ == "__main__":
  _REFERENCE = flags.DEFINE_string("reference", None, "compare.py output dir of the campaign")
  _RERUN = flags.DEFINE_string("rerun", None, "compare.py output dir of the rerun")
  _OUT = flags.DEFINE_string("out", "projects/mhqa/results/repro_check",
                              "output path without extension")
  flags.mark_flags_as_required(["reference", "rerun"])
  app.run(main)
