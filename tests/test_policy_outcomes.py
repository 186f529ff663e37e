"""`projects/mhqa/policy_outcomes.py`: outcome tables, transitions and bars from probe JSONs."""

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("policy_outcomes",
                                               os.path.join(ROOT, "projects", "mhqa",
                                                            "policy_outcomes.py"))
po = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(po)


def _probe(per_question, policy=None):
  n = len(per_question)
  share = {k: sum(v == k for v in per_question.values()) / n for k in po.KINDS}
  seen = {"questions": 3, "outcomes": dict(share, success=0.5, wrong_entity=0.25)}
  unseen = {"questions": 1, "outcomes": dict(share, success=0.0, wrong_entity=1.0)}
  return {"policy": policy, "greedy": {"em": share["success"], "outcomes": share,
                                       "per_question": per_question,
                                       "by_seen": {"seen": seen, "unseen": unseen}},
          "temperatures": {"0.8": {"outcomes": share, "mixed_share": 0.5, "share_bad": 0.25}}}


def test_tables_transitions_and_plot(tmp_path):
  warm = {"a": "misled", "b": "wrong_entity", "c": "success", "d": "misled"}
  trained = {"a": "success", "b": "wrong_entity", "c": "success", "d": "search_missed"}
  (tmp_path / "run.json").write_text(json.dumps(_probe(trained, {"workdir": "w", "step": 30})))
  (tmp_path / "warm_start.json").write_text(json.dumps(_probe(warm)))
  (tmp_path / "other.json").write_text("{}")  # not a probe with outcomes: skipped
  probes = po.load(str(tmp_path))
  assert list(probes) == ["warm_start", "run"]  # the warm start first
  tr = po.transitions(warm, trained)
  assert tr["misled"] == {"success": 1, "search_missed": 1}
  assert tr["wrong_entity"] == {"wrong_entity": 1} and tr["success"] == {"success": 1}
  md = po.markdown(probes)
  assert "| warm_start | 0.250 | 0.000 | 0.500 | 0.250 | 0.000 | 0.000 |" in md
  assert "| misled | 1 | 0 | 0 | 0 | 1 | 0 | 2 |" in md  # to success and to search_missed
  assert "| run | 0.500 | 0.000 | 1.000 | 3 / 1 |" in md
  po.plot(probes, str(tmp_path / "outcomes.png"))
  assert (tmp_path / "outcomes.png").stat().st_size > 1000


def test_no_probe_is_a_clear_error(tmp_path):
  with pytest.raises(SystemExit, match="no probe JSON"):
    po.load(str(tmp_path))
