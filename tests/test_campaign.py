"""The campaign layout (launch/campaign.py): archiving a finished run and reading it back."""

import gzip
import json
import os
import shutil

import pytest

from launch import campaign

RUN = "default/rollouts/grpo-seed0"


def _finished_run(root, recs, summary=None):
  work = root / "runs" / RUN
  work.mkdir(parents=True)
  (work / "summary.json").write_text(json.dumps(summary or {"accuracy_final": 0.4}))
  (work / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
  return work


def test_archive_and_read_back(tmp_path):
  recs = [{"step": i, "effective_ratio": 0.5 + i / 10} for i in range(3)]
  work = _finished_run(tmp_path, recs)
  out = tmp_path / "out"
  arch = campaign.archive_dir(str(out), RUN)
  assert arch == os.path.join(str(out), "runs", RUN)
  assert campaign.archive_run(str(work), arch)
  assert not campaign.archive_run(str(tmp_path / "nothing"), str(tmp_path / "x"))
  # The metrics are gzipped, with no timestamp in the header: archiving twice gives equal bytes.
  with open(campaign.archived_metrics(str(out), RUN), "rb") as f:
    first = f.read()
  assert gzip.decompress(first).decode().count("\n") == 3
  assert campaign.finished_summary(str(tmp_path / "runs"), None, RUN) == str(work / "summary.json")
  shutil.rmtree(tmp_path / "runs")
  # With the workdir gone, the archived copy serves.
  assert campaign.finished_summary(str(tmp_path / "runs"), campaign.archive_dir(str(out)), RUN) \
      == os.path.join(arch, "summary.json")
  assert campaign.finished_summary(str(tmp_path / "runs"), None, RUN) is None
  assert campaign.run_records(str(work), arch) == recs
  assert campaign.run_records(str(work)) == []
  assert campaign.archived_records(str(out), RUN) == recs
  assert campaign.archived_records(str(out), "default/rollouts/grpo-seed9") is None


def test_archive_skips_an_archived_copy_as_new(tmp_path):
  work = _finished_run(tmp_path, [{"step": 0}])
  arch = campaign.archive_dir(str(tmp_path / "out"), RUN)
  campaign.archive_run(str(work), arch)
  (work / "metrics.jsonl").write_text(json.dumps({"step": 7}) + "\n")
  os.utime(work / "summary.json", (0, 0))  # the workdir's summary is older than the archive's
  campaign.archive_run(str(work), arch)
  assert campaign.archived_records(str(tmp_path / "out"), RUN) == [{"step": 0}]
  os.utime(work / "summary.json", None)  # newer again (a resumed run finished): copied anew
  os.utime(os.path.join(arch, "summary.json"), (0, 0))
  campaign.archive_run(str(work), arch)
  assert campaign.archived_records(str(tmp_path / "out"), RUN) == [{"step": 7}]


def test_summary_rows_and_missing_summary(tmp_path):
  with pytest.raises(FileNotFoundError, match="no campaign summary"):
    campaign.read_summary(str(tmp_path))
  assert campaign.read_summary(str(tmp_path), missing_ok=True) is None
  # written atomically: no temporary file is left, and the file reads back
  assert campaign.write_summary(str(tmp_path / "new"), {"runs": [], "x": 3}) is True
  assert os.listdir(tmp_path / "new") == ["summary.json"]
  assert campaign.read_summary(str(tmp_path / "new")) == {"runs": [], "x": 3}
  # A rewrite that changes only when and where it was written leaves the file as it was; a change
  # of contents is written (with its new date).
  new = tmp_path / "stamped"
  assert campaign.write_summary(str(new), {"runs": [], "x": 3, "date": "d1", "machine": {"cpu": 2}})
  assert not campaign.write_summary(str(new), {"runs": [], "x": 3, "date": "d2",
                                               "machine": {"cpu": 8}})
  assert campaign.read_summary(str(new)) == {"runs": [], "x": 3, "date": "d1",
                                             "machine": {"cpu": 2}}
  assert campaign.write_summary(str(new), {"runs": [1], "x": 3, "date": "d3",
                                           "machine": {"cpu": 8}})
  assert campaign.read_summary(str(new)) == {"runs": [1], "x": 3, "date": "d3",
                                             "machine": {"cpu": 8}}
  rows = [dict(method="grpo", seed=0, run=RUN, budget="rollouts")]
  (tmp_path / "summary.json").write_text(json.dumps({"runs": rows, "aggregates": []}))
  assert campaign.summary_rows(str(tmp_path)) == rows
  # A run listed under both budget modes is one run; rows naming no run are all kept.
  both = rows + [dict(rows[0], budget="tokens"), {"method": "old"}, {"method": "old"}]
  (tmp_path / "summary.json").write_text(json.dumps({"runs": both}))
  assert campaign.unique_runs(str(tmp_path)) == [rows[0], {"method": "old"}, {"method": "old"}]
