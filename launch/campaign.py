"""The on-disk layout of a comparison campaign, read and written in one place (no flags, no jax).

A `launch/compare.py` output directory holds

  <out>/summary.json                     {"runs": [row, ...], "aggregates": ..., ...}
  <out>/runs/<run>/summary.json          each finished run's own summary, archived
  <out>/runs/<run>/metrics.jsonl.gz      and its per-step records, gzipped

where `<run>` is `<regime>/<budget>/<method>-seed<seed>`, the run's workdir under `--runs`
(`<workdir>/summary.json`, `<workdir>/metrics.jsonl`). compare.py writes the archive; the
readers (`projects/mhqa/results_table.py`, `projects/mhqa/repro_check.py`,
`projects/mhqa/trap_discovery.py` and
compare.py's own summary) read it through the functions here, so the layout is named once.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil

SUMMARY = "summary.json"
METRICS = "metrics.jsonl"
ARCHIVED_METRICS = METRICS + ".gz"
ARCHIVE = "runs"


def _read_jsonl(path: str) -> list[dict]:
  from trace_jax.metrics import read_jsonl  # imported here: trace_jax.metrics imports jax
  return read_jsonl(path)


def archive_dir(out_dir: str, run: str | None = None) -> str:
  """Where `out_dir` archives its runs, or one run's archived copy."""
  return os.path.join(out_dir, ARCHIVE, run) if run else os.path.join(out_dir, ARCHIVE)


def read_summary(out_dir: str, missing_ok: bool = False) -> dict | None:
  """`<out_dir>/summary.json`; a clear error when it is missing (None with `missing_ok`) or is not
  JSON (never read as empty: a campaign that rewrites its summary would lose its rows)."""
  path = os.path.join(out_dir, SUMMARY)
  if not os.path.exists(path):
    if missing_ok:
      return None
    raise FileNotFoundError(f"{path}: no campaign summary (write it with `launch/compare.py "
                            f"--summarize_only --out={out_dir}`)")
  with open(path) as f:
    try:
      return json.load(f)
    except ValueError as e:
      raise ValueError(f"{path} is not a readable campaign summary ({e}); restore it (e.g. from "
                       "version control) before rerunning, or its rows are lost") from None


# Fields of a summary that say when and where it was written, not what it holds.
WRITE_STAMP = ("date", "machine")


def write_summary(out_dir: str, summary: dict) -> bool:
  """Writes `<out_dir>/summary.json` atomically (a temporary file, then a rename), so a campaign
  stopped while writing keeps its old summary whole. A summary that differs from the one on disk
  only in its `WRITE_STAMP` fields (a rerun that only skipped finished runs) is not rewritten: the
  file keeps the date and machine of the call that last changed its contents. Returns whether the
  file was written (callers rewrite what they derive from it, e.g. a markdown table, only then)."""
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, SUMMARY)
  old = read_summary(out_dir, missing_ok=True) if os.path.exists(path) else None
  if old is not None:
    unstamped = lambda d: {k: v for k, v in d.items() if k not in WRITE_STAMP}  # noqa: E731
    if unstamped(old) == unstamped(json.loads(json.dumps(summary, default=str))):
      return False
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(summary, f, indent=1, default=str)
  os.replace(tmp, path)
  return True


def summary_rows(out_dir: str) -> list[dict]:
  """The rows of the campaign's table (`runs` of its summary)."""
  return list(read_summary(out_dir)["runs"])


def one_per_run(rows) -> list[dict]:
  """Summary rows, one per run: a method without a stage 2 serves both budget modes with one run
  and is listed under each; its first row stands for it. Rows that name no run (carried from
  summaries older than the archive) are kept as they are."""
  seen, out = set(), []
  for r in rows:
    run = r.get("run")
    if run is not None and run in seen:
      continue
    seen.add(run)
    out.append(r)
  return out


def unique_runs(out_dir: str) -> list[dict]:
  """The summary's rows, one per run (`one_per_run`)."""
  return one_per_run(summary_rows(out_dir))


def archived_metrics(out_dir: str, run: str) -> str:
  """Path of one run's archived per-step records (which may not exist)."""
  return os.path.join(archive_dir(out_dir, run), ARCHIVED_METRICS)


def archived_records(out_dir: str, run: str) -> list[dict] | None:
  """One run's archived per-step records; None when the run has none archived."""
  path = archived_metrics(out_dir, run)
  return _read_jsonl(path) if os.path.exists(path) else None


def run_records(workdir: str, archived: str | None = None) -> list[dict]:
  """Per-step records of a run: its workdir's metrics.jsonl, else the archived copy in the
  directory `archived` (`archive_dir(out, run)`); [] when neither exists."""
  for path in (os.path.join(workdir, METRICS),
               os.path.join(archived, ARCHIVED_METRICS) if archived else None):
    if path and os.path.exists(path):
      return _read_jsonl(path)
  return []


def finished_summary(runs_dir: str | None, archive: str | None, run: str) -> str | None:
  """The summary.json of a finished run: its workdir's under `runs_dir`, else the archived copy
  under `archive`; None when the run has not finished."""
  for d in (runs_dir, archive):
    path = os.path.join(d, run, SUMMARY) if d else None
    if path and os.path.exists(path):
      return path
  return None


def archive_run(workdir: str, archived: str) -> bool:
  """Copies a finished run's summary.json and its metrics (gzipped) to `archived`, unless the
  archived summary is already as new; False when the workdir has no summary (an archived-only
  run)."""
  src = os.path.join(workdir, SUMMARY)
  if not os.path.exists(src):
    return False
  dst = os.path.join(archived, SUMMARY)
  if os.path.exists(dst) and os.path.getmtime(dst) >= os.path.getmtime(src):
    return True
  os.makedirs(archived, exist_ok=True)
  shutil.copyfile(src, dst)
  metrics = os.path.join(workdir, METRICS)
  if os.path.exists(metrics):
    with open(metrics, "rb") as f, gzip.GzipFile(os.path.join(archived, ARCHIVED_METRICS), "wb",
                                                  mtime=0) as g:
      shutil.copyfileobj(f, g)
  return True
