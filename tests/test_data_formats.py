"""Readers for the standard QA formats, on small fixtures written here."""

import csv
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trace_jax.data import formats
from trace_jax.data.formats import QAExample
from trace_jax.data.formats import QAFormatError
from trace_jax.data.formats import load_qa

SEARCHR1_PREFIX = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every "
    "time you get new information. ... For example, <answer> Beijing </answer>. Question: ")


def _write_json(path, data):
  path.write_text(json.dumps(data))
  return path


def _write_jsonl(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return path


def _searchr1_row(i, question, target, source="hotpotqa"):
  return {
      "id": f"train_{i}",
      "question": question,
      "golden_answers": target if isinstance(target, list) else [target],
      "data_source": source,
      "prompt": [{"content": SEARCHR1_PREFIX + question + "\n", "role": "user"}],
      "ability": "fact-reasoning",
      "reward_model": {"ground_truth": {"target": target}, "style": "rule"},
      "extra_info": {"index": i, "split": "train"},
  }


def test_searchr1_parquet(tmp_path):
  rows = [_searchr1_row(0, "Who founded Acme?", ["Ada", "Ada Lovelace"]),
          _searchr1_row(1, "Where is Zork?", ["Paris"], source="nq")]
  path = tmp_path / "train.parquet"
  pq.write_table(pa.Table.from_pylist(rows), path)
  examples, stats = load_qa(path, return_stats=True)
  assert stats.format == "searchr1" and stats.kept == 2 and stats.skipped == 0
  assert examples[0] == QAExample("train_0", "Who founded Acme?", ("Ada", "Ada Lovelace"),
                                  "hotpotqa", examples[0].meta)
  assert examples[0].meta["extra_info"] == {"index": 0, "split": "train"}
  assert examples[1].source == "nq" and examples[1].answers == ("Paris",)


def test_searchr1_question_from_prompt_only(tmp_path):
  """Without `question`/`id` columns the question comes from the chat prompt."""
  row = _searchr1_row(7, "Who wrote Zed?", "Bo")  # target as a plain string
  for key in ("question", "id", "golden_answers"):
    del row[key]
  path = tmp_path / "t.parquet"
  pq.write_table(pa.Table.from_pylist([row]), path)
  [ex] = load_qa(path)
  assert ex.question == "Who wrote Zed?"
  assert ex.answers == ("Bo",)
  assert ex.id == "hotpotqa_train_7"


def test_flashrag_jsonl(tmp_path):
  path = _write_jsonl(tmp_path / "dev.jsonl", [
      {"id": "test_0", "question": "Q0?", "golden_answers": ["a", "A b"], "metadata": {"x": 1}},
      {"id": "test_1", "question": "Q1?", "golden_answers": ["c"]},
  ])
  examples = load_qa(path, source="nq")
  assert [e.id for e in examples] == ["test_0", "test_1"]
  assert examples[0].answers == ("a", "A b") and examples[0].meta == {"metadata": {"x": 1}}
  assert {e.source for e in examples} == {"nq"}


def test_hotpotqa_json(tmp_path):
  path = _write_json(tmp_path / "hotpot_dev.json", [
      {"_id": "5a8b", "question": "Which is older?", "answer": "yes", "type": "comparison",
       "level": "hard", "supporting_facts": [["A", 0]], "context": [["A", ["s"]]]},
  ])
  [ex] = load_qa(path)
  assert ex == QAExample("5a8b", "Which is older?", ("yes",), "hotpotqa",
                         {"type": "comparison", "level": "hard"})


def test_2wiki_json_with_aliases(tmp_path):
  path = _write_json(tmp_path / "2wiki_dev.json", [
      {"_id": "w1", "type": "compositional", "question": "Who is the father of X?",
       "context": [], "supporting_facts": [], "evidences": [["X", "father", "Y"]],
       "answer": "Y", "answer_aliases": ["Mr Y", "Y"]},
  ])
  [ex] = load_qa(path)
  assert ex.source == "2wiki"
  assert ex.answers == ("Y", "Mr Y")  # de-duplicated, canonical answer first
  assert ex.meta == {"type": "compositional", "evidences": [["X", "father", "Y"]]}


def test_musique_skips_unanswerable(tmp_path):
  path = _write_jsonl(tmp_path / "musique_dev.jsonl", [
      {"id": "2hop__1_2", "question": "Q?", "answer": "A", "answer_aliases": ["AA"],
       "answerable": True, "paragraphs": []},
      {"id": "3hop1__3", "question": "R?", "answer": "", "answer_aliases": [],
       "answerable": False},
      {"id": "2hop__4", "question": "S?", "answer": "B", "answer_aliases": [], "answerable": False},
  ])
  examples, stats = load_qa(path, return_stats=True)
  assert [e.id for e in examples] == ["2hop__1_2"]
  assert examples[0].answers == ("A", "AA") and examples[0].meta == {"hops": 2}
  assert stats.skipped_unanswerable == 2 and stats.skipped_no_answer == 0
  assert stats.records == 3 and stats.kept == 1


@pytest.mark.parametrize("ext", ["json", "jsonl", "csv"])
def test_bamboogle(tmp_path, ext):
  records = [{"Question": "Who was president when X?", "Answer": "Y"},
             {"Question": "What is Z?", "Answer": "W"}]
  path = tmp_path / f"bamboogle.{ext}"
  if ext == "json":
    _write_json(path, records)
  elif ext == "jsonl":
    _write_jsonl(path, records)
  else:
    with open(path, "w", newline="") as f:
      writer = csv.DictWriter(f, fieldnames=["Question", "Answer"])
      writer.writeheader()
      writer.writerows(records)
  examples = load_qa(path)
  assert [(e.id, e.question, e.answers, e.source) for e in examples] == [
      ("bamboogle_0", "Who was president when X?", ("Y",), "bamboogle"),
      ("bamboogle_1", "What is Z?", ("W",), "bamboogle")]


def test_missing_answers_are_counted_not_silent(tmp_path, caplog):
  path = _write_jsonl(tmp_path / "f.jsonl", [
      {"id": "a", "question": "Q?", "golden_answers": ["x"]},
      {"id": "b", "question": "Q?", "golden_answers": []},
      {"id": "c", "question": "Q?", "golden_answers": ["  "]},
      {"id": "d", "question": "Q?"},
  ])
  with caplog.at_level("WARNING"):
    examples, stats = load_qa(path, return_stats=True)
  assert [e.id for e in examples] == ["a"]
  assert stats.skipped_no_answer == 3 and stats.skipped == 3
  assert "skipped 3 without answers" in caplog.text


@pytest.mark.parametrize("record, field", [
    ({"id": "x", "golden_answers": ["a"]}, "question"),
    ({"id": "x", "question": "", "golden_answers": ["a"]}, "question"),
    ({"id": "x", "question": "Q?", "golden_answers": {"a": 1}}, "golden_answers"),
    ({"id": ["x"], "question": "Q?", "golden_answers": ["a"]}, "id"),
    ({"id": "x", "question": "Q?", "golden_answers": [None]}, "golden_answers"),
])
def test_malformed_record_names_file_record_field(tmp_path, record, field):
  good = {"id": "ok", "question": "Q?", "golden_answers": ["a"]}
  path = _write_jsonl(tmp_path / "bad.jsonl", [good, good, record])
  with pytest.raises(QAFormatError) as info:
    load_qa(path, format="flashrag")
  err = info.value
  assert (err.record, err.field) == (2, field)
  assert str(path) in str(err) and "record 2" in str(err) and repr(field) in str(err)


def test_malformed_musique_answerable(tmp_path):
  path = _write_jsonl(tmp_path / "m.jsonl", [
      {"id": "2hop__1", "question": "Q?", "answer": "A", "answerable": "yes"}])
  with pytest.raises(QAFormatError, match=r"record 0: field 'answerable'"):
    load_qa(path)


def test_invalid_json_line(tmp_path):
  path = tmp_path / "broken.jsonl"
  path.write_text('{"id": "a", "question": "Q?", "golden_answers": ["x"]}\n\n{"id": oops}\n')
  with pytest.raises(QAFormatError, match=r"broken.jsonl: record 1: invalid JSON on line 3"):
    load_qa(path)


def test_searchr1_bad_prompt(tmp_path):
  row = _searchr1_row(0, "Q?", ["a"])
  del row["question"]
  row["prompt"] = [{"content": "", "role": "user"}]
  path = tmp_path / "bad.parquet"
  pq.write_table(pa.Table.from_pylist([row]), path)
  with pytest.raises(QAFormatError, match=r"bad.parquet: record 0: field 'prompt'"):
    load_qa(path)


def test_unknown_format_and_keys(tmp_path):
  path = _write_jsonl(tmp_path / "x.jsonl", [{"foo": 1}])
  with pytest.raises(QAFormatError, match="cannot tell the QA format"):
    load_qa(path)
  with pytest.raises(ValueError, match="unknown QA format"):
    load_qa(path, format="squad")
  with pytest.raises(FileNotFoundError):
    load_qa(tmp_path / "missing.json")


def test_detect_format():
  assert formats.detect_format({"reward_model", "prompt", "data_source"}) == "searchr1"
  assert formats.detect_format({"id", "question", "golden_answers"}) == "flashrag"
  assert formats.detect_format({"_id", "question", "answer", "level"}) == "hotpotqa"
  assert formats.detect_format({"_id", "question", "answer", "evidences"}) == "2wiki"
  assert formats.detect_format({"id", "question", "answer", "answerable"}) == "musique"
  assert formats.detect_format({"Question", "Answer"}) == "bamboogle"
