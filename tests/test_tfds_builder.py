"""TFDS array_record build and read-back, without TensorFlow."""

import dataclasses
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorflow_datasets as tfds

from trace_jax.data.formats import QAExample
from trace_jax.data.formats import load_qa
from trace_jax.data.tfds_builder import build_qa_dataset
from trace_jax.data.tfds_builder import qa_data_source

tfds.disable_progress_bar()


def _write_inputs(tmp_path):
  rows = [{"data_source": "hotpotqa" if i % 2 else "nq",
           "prompt": [{"role": "user", "content": f"Answer it. Question: Who made thing {i}?\n"}],
           "reward_model": {"ground_truth": {"target": [f"maker {i}", f"m{i}"]}, "style": "rule"},
           "extra_info": {"index": i, "split": "train"}} for i in range(7)]
  train = tmp_path / "train.parquet"
  pq.write_table(pa.Table.from_pylist(rows), train)
  test = tmp_path / "test.jsonl"
  records = [{"id": f"test_{i}", "question": f"Où est {i}? ✓", "golden_answers": [f"place {i}"],
              "metadata": {"hop": i}} for i in range(4)]
  records.insert(2, {"id": "no_answer", "question": "?", "golden_answers": []})
  test.write_text("".join(json.dumps(r) + "\n" for r in records))
  return train, test


def test_build_and_read_back_equals_input(tmp_path):
  train, test = _write_inputs(tmp_path)
  data_dir = tmp_path / "tfds"
  builder = build_qa_dataset(data_dir, train_path=train, test_path=test, name="mixed")
  assert builder.info.splits["train"].num_examples == 7
  assert builder.info.splits["test"].num_examples == 4
  assert builder.info.metadata["test"]["skipped_no_answer"] == 1
  assert builder.info.metadata["train"]["format"] == "searchr1"
  for split, path in (("train", train), ("test", test)):
    expected = load_qa(path)
    got = qa_data_source(data_dir, split, name="mixed")
    assert len(got) == len(expected)
    assert list(got) == expected  # Same order, ids, answers, sources and meta.
    assert got[-1] == expected[-1] and got[1:3] == expected[1:3]
  with pytest.raises(IndexError):
    qa_data_source(data_dir, "test", name="mixed")[4]
  # The plain TFDS entry point reads the same files.
  raw = tfds.data_source("trace_qa/mixed", split="train", data_dir=str(data_dir))
  assert raw[0]["answers"] == [b"maker 0", b"m0"]
  assert "tensorflow" not in sys.modules


def test_rebuild_reuses_and_guards_other_inputs(tmp_path):
  train, test = _write_inputs(tmp_path)
  data_dir = tmp_path / "tfds"
  build_qa_dataset(data_dir, train_path=train, test_path=test, name="d")
  files = sorted(os.listdir(data_dir / "trace_qa" / "d" / "1.0.0"))
  assert any(f.startswith("trace_qa-train.array_record") for f in files)
  build_qa_dataset(data_dir, train_path=train, test_path=test, name="d")  # Reused, no error.
  with pytest.raises(ValueError, match="built from other inputs"):
    build_qa_dataset(data_dir, train_path=test, test_path=train, name="d")
  builder = build_qa_dataset(data_dir, train_path=test, name="d", overwrite=True)
  assert set(builder.info.splits) == {"train"}
  assert list(qa_data_source(data_dir, "train", name="d")) == load_qa(test)


@dataclasses.dataclass
class _Question:
  id: str
  question: str
  answers: tuple
  hops: int
  chain: list  # Not a scalar: not copied into meta.


class _World:
  def __init__(self):
    self.train = [_Question(f"w{i}", f"where was {i} born?", (f"city{i}",), 1 + i % 3, [i])
                  for i in range(5)]
    self.test = [{"id": "t0", "question": "who founded x?", "answers": ["y", "z"], "hops": 2}]


def test_build_from_synthetic_world(tmp_path):
  builder = build_qa_dataset(tmp_path, world=_World(), name="synthetic_seed0")
  assert builder.info.splits["train"].num_examples == 5
  train = list(qa_data_source(tmp_path, "train", name="synthetic_seed0"))
  assert train[3] == QAExample("w3", "where was 3 born?", ("city3",), "synthetic", {"hops": 1})
  [test] = qa_data_source(tmp_path, "test", name="synthetic_seed0")
  assert test == QAExample("t0", "who founded x?", ("y", "z"), "synthetic", {"hops": 2})


def test_read_in_fresh_process_without_builder_code(tmp_path):
  """A reader needs only the files: no builder import, no inputs, no TensorFlow."""
  train, test = _write_inputs(tmp_path)
  build_qa_dataset(tmp_path / "tfds", train_path=train, test_path=test, name="mixed")
  os.remove(train)
  code = (
      "import sys, tensorflow_datasets as tfds\n"
      f"ds = tfds.data_source('trace_qa/mixed', split='test', "
      f"data_dir={str(tmp_path / 'tfds')!r})\n"
      "print(len(ds), ds[3]['question'].decode())\n"
      "assert 'tensorflow' not in sys.modules\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "4 Où est 3? ✓"


def test_nothing_to_build(tmp_path):
  with pytest.raises(ValueError, match="train_path"):
    build_qa_dataset(tmp_path)


def test_build_from_saved_synthetic_world(tmp_path):
  from trace_jax.envs.worlds.synthetic_world import SyntheticWorldConfig
  from trace_jax.envs.worlds.synthetic_world import generate_world

  world = generate_world(SyntheticWorldConfig(seed=3, n_entities=120, n_train=12, n_test=4))
  world.save(str(tmp_path / "world"))
  builder = build_qa_dataset(tmp_path / "tfds", world=tmp_path / "world", name="world3")
  assert builder.info.metadata["test"]["input"] == f"synthetic world {tmp_path / 'world'}"
  for split, records in (("train", world.train), ("test", world.test)):
    got = list(qa_data_source(tmp_path / "tfds", split, name="world3"))
    assert [(e.id, e.question, list(e.answers)) for e in got] == [
        (r.id, r.question, r.answers) for r in records]
    assert [e.meta for e in got] == [{**r.meta, "hops": r.hops} for r in records]
