"""A TFDS array_record builder for QA datasets, readable without TensorFlow.

Build once from local files (any format `load_qa` reads) or from a synthetic world, then read with
random access through `tfds.data_source`, which needs neither TensorFlow nor the original files:

  build_qa_dataset("/data/tfds", train_path="train.parquet", test_path="test.parquet",
                   name="nq_hotpotqa")
  test = qa_data_source("/data/tfds", "test", name="nq_hotpotqa")   # Sequence[QAExample]
  # equivalently: tfds.data_source("trace_qa/nq_hotpotqa", split="test", data_dir="/data/tfds")

Each named dataset is a builder config of the `trace_qa` builder, stored under
`{data_dir}/trace_qa/{name}/{version}/`. Examples keep their input order (shuffling is disabled) so
evaluation order and ids are reproducible. `meta` is stored as a JSON string. The per-split record
counts and skip counts of `load_qa` are kept in the dataset's metadata (`builder.info.metadata`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterable, Sequence

from etils import epath
import tensorflow_datasets as tfds

from trace_jax.data.formats import LoadStats
from trace_jax.data.formats import QAExample
from trace_jax.data.formats import load_qa

BUILDER_NAME = "trace_qa"
SPLITS = ("train", "test")


@dataclasses.dataclass(eq=False)
class QAConfig(tfds.core.BuilderConfig):
  """Names one QA dataset and where its splits come from.

  Attributes:
    paths: split name -> local file read with `load_qa`.
    format: the file format, or None to detect it per file.
    source: overrides `QAExample.source` for every example.
    world: any object with `.train` / `.test` lists of records (objects or dicts) that have `id`,
      `question` and `answers` (or `answer`); used for splits without a path.
    world_dir: the directory the world was loaded from, when it was (recorded as the input).
  """

  paths: dict[str, str] = dataclasses.field(default_factory=dict)
  format: str | None = None
  source: str | None = None
  # Not in the repr: TFDS logs the config, and a world's repr holds its whole corpus.
  world: Any = dataclasses.field(default=None, repr=False)
  world_dir: str | None = None


class TraceQA(tfds.core.GeneratorBasedBuilder):
  """Multi-hop QA questions with all accepted answers."""

  name = BUILDER_NAME
  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "id, question, answers, source, meta (JSON)."}
  # TFDS finds a builder's source file through `importlib_resources` (not a dependency here) only
  # to look for a checksums file next to it; name the file directly so that look-up is skipped.
  code_path = epath.Path(__file__)

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description="Multi-hop QA examples: question and accepted answers.",
        features=tfds.features.FeaturesDict({
            "id": tfds.features.Text(),
            "question": tfds.features.Text(),
            "answers": tfds.features.Sequence(tfds.features.Text()),
            "source": tfds.features.Text(),
            "meta": tfds.features.Text(),
        }),
        # Input order is meaningful (ids, evaluation order); keep it.
        disable_shuffling=True,
        metadata=tfds.core.MetadataDict(),
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing is downloaded.
    config: QAConfig = self.builder_config
    splits = {}
    for split, origin in _inputs(config).items():
      if split in config.paths:
        examples, stats = load_qa(origin, format=config.format, source=config.source,
                                  return_stats=True)
      else:
        examples = world_examples(getattr(config.world, split), source=config.source)
        stats = LoadStats(origin, "synthetic", records=len(examples), kept=len(examples))
      # Saved with dataset_info, so a reader can see what was skipped and where it came from.
      summary = dataclasses.asdict(stats)
      summary["input"] = summary.pop("path")
      self.info.metadata[split] = summary
      if not examples:
        raise ValueError(f"split {split!r} of {config.name!r} has no usable examples")
      splits[split] = self._generate_examples(examples)
    return splits

  def _generate_examples(self, examples: Sequence[QAExample]):
    for i, ex in enumerate(examples):
      # The position is the key: ids need not be unique across sources.
      yield i, {"id": ex.id, "question": ex.question, "answers": list(ex.answers),
                "source": ex.source, "meta": json.dumps(ex.meta, sort_keys=True, default=str)}


def _field(record: Any, name: str, default: Any = None) -> Any:
  if isinstance(record, dict):
    return record.get(name, default)
  return getattr(record, name, default)


def world_examples(records: Iterable[Any], source: str | None = None) -> list[QAExample]:
  """Converts synthetic-world records (objects or dicts with id/question/answers) to QAExamples.

  Scalar extra fields of a dataclass or dict record (hop count, relation names, ...) go to `meta`.
  """
  out = []
  for i, rec in enumerate(records):
    answers = _field(rec, "answers")
    if answers is None:
      answers = _field(rec, "answer")
    if isinstance(answers, str):
      answers = [answers]
    qid, question = _field(rec, "id", i), _field(rec, "question")
    if not question or not answers:
      raise ValueError(f"synthetic record {i} ({qid!r}) needs a question and answers")
    if isinstance(rec, dict):
      extras = rec
    elif dataclasses.is_dataclass(rec):
      extras = {f.name: getattr(rec, f.name) for f in dataclasses.fields(rec)}
    else:
      extras = {}
    meta = dict(_field(rec, "meta", None) or {})
    for key, value in extras.items():
      if key not in ("id", "question", "answers", "answer", "meta") and (
          value is None or isinstance(value, (str, int, float, bool))):
        meta[key] = value
    out.append(QAExample(id=str(qid), question=str(question),
                         answers=tuple(str(a) for a in answers),
                         source=source or "synthetic", meta=meta))
  return out


def _inputs(config: QAConfig) -> dict[str, str]:
  """Split -> what it is built from, as recorded in the dataset metadata."""
  origin = f"synthetic world {config.world_dir}" if config.world_dir else "synthetic world"
  inputs = dict.fromkeys(SPLITS, origin) if config.world is not None else {}
  return {**inputs, **config.paths}


def build_qa_dataset(data_dir: str | os.PathLike, train_path: str | None = None,
                     test_path: str | None = None, name: str = "qa", *,
                     world: Any = None, format: str | None = None, source: str | None = None,
                     extra_paths: dict[str, str] | None = None,
                     overwrite: bool = False) -> TraceQA:
  """Builds (or reuses) the array_record dataset `trace_qa/{name}` under `data_dir`.

  Args:
    data_dir: the TFDS data directory.
    train_path, test_path: local QA files of any `load_qa` format.
    name: the dataset's config name, e.g. "hotpotqa" or "synthetic_seed0".
    world: a synthetic world (`.train` / `.test` record lists) for splits without a path, or the
      directory a `synthetic_world.World` was saved to.
    format, source: passed to `load_qa`.
    extra_paths: more splits, e.g. {"validation": "dev.jsonl"}.
    overwrite: rebuild even if a build of this name and version exists.

  Returns:
    The prepared builder; `builder.as_data_source()` gives the splits.

  Raises:
    ValueError: when nothing to build is given, or an existing build came from other inputs and
      `overwrite` is False (reusing it silently would train on the wrong data).
  """
  if isinstance(world, (str, os.PathLike)):
    from trace_jax.envs.worlds.synthetic_world import World  # Lazy: file datasets do not need it.

    world_dir, world = os.path.abspath(world), World.load(os.fspath(world))
  else:
    world_dir = None
  paths = {k: os.path.abspath(v) for k, v in
           {"train": train_path, "test": test_path, **(extra_paths or {})}.items() if v}
  if not paths and world is None:
    raise ValueError("give train_path/test_path or a synthetic world")
  config = QAConfig(name=name, version=TraceQA.VERSION, paths=paths, format=format,
                    source=source, world=world, world_dir=world_dir,
                    description=f"QA dataset {name} from {paths or 'a synthetic world'}")
  builder = TraceQA(data_dir=os.fspath(data_dir), config=config, file_format="array_record")
  mode = tfds.download.GenerateMode.REUSE_DATASET_IF_EXISTS
  if builder.is_prepared():
    if overwrite:
      mode = tfds.download.GenerateMode.REUSE_CACHE_IF_EXISTS  # Regenerates the data files.
    elif {s: m.get("input") for s, m in builder.info.metadata.items()} != _inputs(config):
      raise ValueError(
          f"{builder.data_dir} was built from other inputs ({dict(builder.info.metadata)}); "
          "pass overwrite=True or another name")
  builder.download_and_prepare(download_config=tfds.download.DownloadConfig(download_mode=mode))
  return builder


class QADataSource(Sequence[QAExample]):
  """Random-access, TensorFlow-free view of one split as QAExamples."""

  def __init__(self, source):
    self._source = source

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index):
    if isinstance(index, slice):
      return [self[i] for i in range(*index.indices(len(self)))]
    n = len(self)
    if not -n <= index < n:
      raise IndexError(f"index {index} out of range for {n} examples")
    return decode_example(self._source[index % n])

  def __iter__(self):
    for i in range(len(self)):
      yield self[i]

  def __repr__(self) -> str:
    return f"QADataSource({self._source!r})"


def decode_example(raw: dict) -> QAExample:
  """Turns one stored TFDS example (bytes fields) back into a QAExample."""

  def text(value):
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)

  return QAExample(id=text(raw["id"]), question=text(raw["question"]),
                   answers=tuple(text(a) for a in raw["answers"]), source=text(raw["source"]),
                   meta=json.loads(text(raw["meta"])))


def qa_data_source(data_dir: str | os.PathLike, split: str, name: str = "qa",
                   version: str | None = None) -> QADataSource:
  """Opens split `split` of a built `trace_qa/{name}` dataset as a sequence of QAExamples.

  Reads only the files under data_dir (through the dataset_info stored there), so it works in a
  process that never saw the input files or the synthetic world.
  """
  source = tfds.data_source(f"{BUILDER_NAME}/{name}" + (f":{version}" if version else ""),
                            split=split, data_dir=os.fspath(data_dir))
  return QADataSource(source)
