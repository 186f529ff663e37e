"""Readers for the standard multi-hop QA file formats, all into one `QAExample` type.

Supported (`format=` names):

- `searchr1`  Search-R1 parquet: `data_source`, `prompt` (chat messages; the question is the text
              after the last "Question:" of the user turn, or the `question` column when present),
              `reward_model.ground_truth.target`, `extra_info`.
- `flashrag`  FlashRAG jsonl: `id`, `question`, `golden_answers`.
- `hotpotqa`  HotpotQA JSON list: `_id`, `question`, `answer`, `type`, `level`.
- `2wiki`     2WikiMultihopQA JSON list: `_id`, `question`, `answer`, `type`, `evidences`
              (`answer_aliases` when present).
- `musique`   MuSiQue jsonl: `id`, `question`, `answer`, `answer_aliases`, `answerable`.
- `bamboogle` Bamboogle: `Question`, `Answer` as json, jsonl or csv.

A record whose answers are missing or empty is skipped and counted, as is an unanswerable MuSiQue
record; a record that is malformed in any other way raises `QAFormatError` naming the file, the
record number and the field, because silently training on half-parsed data is worse than stopping.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import os
from typing import Any, Callable, Iterator

FORMATS = ("searchr1", "flashrag", "hotpotqa", "2wiki", "musique", "bamboogle")


@dataclasses.dataclass(frozen=True)
class QAExample:
  """One question with every accepted answer string. `meta` holds format-specific extras."""

  id: str
  question: str
  answers: tuple[str, ...]
  source: str
  meta: dict = dataclasses.field(default_factory=dict, hash=False)


@dataclasses.dataclass
class LoadStats:
  """What `load_qa` did with each record of a file."""

  path: str
  format: str
  records: int = 0
  kept: int = 0
  skipped_no_answer: int = 0
  skipped_unanswerable: int = 0

  @property
  def skipped(self) -> int:
    return self.skipped_no_answer + self.skipped_unanswerable


class QAFormatError(ValueError):
  """A file or record that cannot be read; the message names file, record and field."""

  def __init__(self, path: str, message: str, record: int | None = None, field: str | None = None):
    self.path, self.record, self.field = str(path), record, field
    where = str(path)
    if record is not None:
      where += f": record {record}"
    if field is not None:
      where += f": field {field!r}"
    super().__init__(f"{where}: {message}")


class _Skip(Exception):
  """Raised by a record parser for a record that is valid but must not be used."""

  def __init__(self, reason: str):
    super().__init__(reason)
    self.reason = reason  # "no_answer" or "unanswerable"


class _FieldError(Exception):
  def __init__(self, field: str, message: str):
    super().__init__(message)
    self.field, self.message = field, message


# ----------------------------------------------------------------------------- field helpers


def _get(rec: dict, field: str) -> Any:
  if field not in rec:
    raise _FieldError(field, "missing")
  return rec[field]


def _text(rec: dict, field: str) -> str:
  value = _get(rec, field)
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    value = str(value)
  if not isinstance(value, str) or not value.strip():
    raise _FieldError(field, f"expected a non-empty string, got {value!r:.80}")
  return value.strip()


def _answers(*values: tuple[str, Any]) -> tuple[str, ...]:
  """Merges answer fields (name, value) into a de-duplicated tuple; raises _Skip when empty.

  A value may be a string, a number or a list of them; None / missing means no answer.
  """
  out: list[str] = []
  for field, value in values:
    if value is None:
      continue
    items = [value] if isinstance(value, (str, int, float)) else value
    if not isinstance(items, (list, tuple)):
      raise _FieldError(field, "expected a string or a list of strings, got "
                        f"{type(value).__name__}")
    for item in items:
      if isinstance(item, bool) or not isinstance(item, (str, int, float)):
        raise _FieldError(field, f"expected answer strings, got {item!r:.80}")
      item = str(item).strip()
      if item and item not in out:
        out.append(item)
  if not out:
    raise _Skip("no_answer")
  return tuple(out)


def _id(rec: dict, field: str, index: int, prefix: str) -> str:
  value = rec.get(field)
  if value is None or value == "":
    return f"{prefix}_{index}"
  if isinstance(value, bool) or not isinstance(value, (str, int)):
    raise _FieldError(field, f"expected a string id, got {value!r:.80}")
  return str(value)


def _jsonable(value: Any) -> Any:
  """Keeps meta JSON-serializable (parquet can hand back bytes or odd scalars)."""
  return json.loads(json.dumps(value, default=str))


# ----------------------------------------------------------------------------- record parsers
# Each parser maps (record, index) -> (id, question, answers, meta, source or None).


def _question_from_prompt(prompt: Any) -> str:
  if isinstance(prompt, str):
    content = prompt
  elif isinstance(prompt, (list, tuple)) and prompt:
    users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    msg = (users or [m for m in prompt if isinstance(m, dict)] or [None])[-1]
    content = msg.get("content") if msg else None
  else:
    content = None
  if not isinstance(content, str) or not content.strip():
    raise _FieldError("prompt", "expected chat messages with a non-empty user content")
  # Search-R1 prompts end with "Question: <question>\n" after the instructions.
  marker = content.rfind("Question:")
  question = content[marker + len("Question:"):] if marker >= 0 else content
  if not question.strip():
    raise _FieldError("prompt", "no question text after 'Question:'")
  return question.strip()


def _parse_searchr1(rec: dict, index: int):
  if isinstance(rec.get("question"), str) and rec["question"].strip():
    question = rec["question"].strip()
  else:
    question = _question_from_prompt(_get(rec, "prompt"))
  target = None
  reward_model = rec.get("reward_model")
  if reward_model is not None:
    if not isinstance(reward_model, dict):
      raise _FieldError("reward_model", "expected a struct with ground_truth.target")
    truth = reward_model.get("ground_truth")
    if isinstance(truth, dict):
      target = truth.get("target")
    elif truth is not None:
      target = truth
  answers = _answers(("reward_model.ground_truth.target", target),
                     ("golden_answers", rec.get("golden_answers")))
  source = rec.get("data_source")
  source = str(source) if source else None
  extra = rec.get("extra_info") or {}
  meta = {"data_source": source, "extra_info": _jsonable(extra)}
  if rec.get("id") not in (None, ""):
    qid = _id(rec, "id", index, "")
  elif isinstance(extra, dict) and "index" in extra:
    qid = f"{source or 'searchr1'}_{extra.get('split', 'x')}_{extra['index']}"
  else:
    qid = f"{source or 'searchr1'}_{index}"
  return qid, question, answers, meta, source


def _parse_flashrag(rec: dict, index: int):
  answers = _answers(("golden_answers", rec.get("golden_answers")))
  meta = {"metadata": _jsonable(rec["metadata"])} if "metadata" in rec else {}
  return _id(rec, "id", index, "flashrag"), _text(rec, "question"), answers, meta, None


def _parse_hotpotqa(rec: dict, index: int):
  answers = _answers(("answer", rec.get("answer")))
  meta = {k: rec[k] for k in ("type", "level") if k in rec}
  return _id(rec, "_id", index, "hotpotqa"), _text(rec, "question"), answers, meta, None


def _parse_2wiki(rec: dict, index: int):
  answers = _answers(("answer", rec.get("answer")), ("answer_aliases", rec.get("answer_aliases")))
  meta = {k: _jsonable(rec[k]) for k in ("type", "evidences") if k in rec}
  return _id(rec, "_id", index, "2wiki"), _text(rec, "question"), answers, meta, None


def _parse_musique(rec: dict, index: int):
  answerable = rec.get("answerable", True)
  if not isinstance(answerable, bool):
    raise _FieldError("answerable", f"expected a boolean, got {answerable!r:.40}")
  if not answerable:
    raise _Skip("unanswerable")
  answers = _answers(("answer", rec.get("answer")), ("answer_aliases", rec.get("answer_aliases")))
  qid = _id(rec, "id", index, "musique")
  # MuSiQue ids start with the hop count ("2hop__...", "3hop1__..."), a useful difficulty label.
  meta = {"hops": int(qid[0])} if qid[:1].isdigit() and "hop" in qid else {}
  return qid, _text(rec, "question"), answers, meta, None


def _parse_bamboogle(rec: dict, index: int):
  answers = _answers(("Answer", rec.get("Answer")))
  return _id(rec, "id", index, "bamboogle"), _text(rec, "Question"), answers, {}, None


_PARSERS: dict[str, Callable] = {
    "searchr1": _parse_searchr1,
    "flashrag": _parse_flashrag,
    "hotpotqa": _parse_hotpotqa,
    "2wiki": _parse_2wiki,
    "musique": _parse_musique,
    "bamboogle": _parse_bamboogle,
}


# ----------------------------------------------------------------------------- file reading


def _iter_records(path: str) -> Iterator[tuple[int, Any]]:
  """Yields (record number, record) from parquet, csv, a JSON list, or JSON lines.

  Record numbers are 0-based positions; for JSON lines they count non-empty lines.
  """
  ext = os.path.splitext(path)[1].lower()
  if ext == ".parquet":
    import pyarrow.parquet as pq  # Lazy: only parquet needs it.

    try:
      rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several unrelated types for bad files.
      raise QAFormatError(path, f"not a readable parquet file ({e})") from e
    yield from enumerate(rows)
    return
  if ext == ".csv":
    with open(path, newline="", encoding="utf-8-sig") as f:
      yield from enumerate(csv.DictReader(f))
    return
  with open(path, encoding="utf-8") as f:
    if ext == ".json":
      text = f.read()
      try:
        data = json.loads(text)
      except json.JSONDecodeError:
        data = None  # Some dumps named .json are really JSON lines; fall through.
      if data is not None:
        if isinstance(data, dict):
          # {"data": [...]} wrappers appear in a few releases.
          lists = [v for v in data.values() if isinstance(v, list)]
          if len(lists) != 1:
            raise QAFormatError(path, "expected a JSON list of records")
          data = lists[0]
        if not isinstance(data, list):
          raise QAFormatError(path, "expected a JSON list of records")
        yield from enumerate(data)
        return
      lines = text.splitlines()
    else:
      lines = f
    index = 0
    for line_no, line in enumerate(lines, 1):
      if not line.strip():
        continue
      try:
        rec = json.loads(line)
      except json.JSONDecodeError as e:
        raise QAFormatError(path, f"invalid JSON on line {line_no} ({e.msg})", record=index) from e
      yield index, rec
      index += 1


def detect_format(keys: set[str] | dict, path: str = "") -> str:
  """Names the format of a record from its keys (and the file extension as a tie-breaker)."""
  keys = set(keys)
  if "reward_model" in keys or ("prompt" in keys and "data_source" in keys):
    return "searchr1"
  if "golden_answers" in keys:
    return "flashrag"
  if "Question" in keys and "Answer" in keys:
    return "bamboogle"
  if "_id" in keys:
    return "2wiki" if "evidences" in keys or "entity_ids" in keys else "hotpotqa"
  if "answerable" in keys or "answer_aliases" in keys or "question_decomposition" in keys:
    return "musique"
  raise QAFormatError(path, f"cannot tell the QA format from the record keys {sorted(keys)}",
                      record=0)


def load_qa(path: str | os.PathLike, format: str | None = None, source: str | None = None,
            return_stats: bool = False):
  """Reads a QA file of any supported format into `QAExample`s.

  Args:
    path: a .parquet, .json, .jsonl or .csv file.
    format: one of FORMATS; detected from the first record's keys when None.
    source: the `source` of every example; defaults to the format name (for Search-R1, to each
      row's `data_source`).
    return_stats: also return a `LoadStats` with the number of skipped records.

  Returns:
    list[QAExample], or (list[QAExample], LoadStats) when return_stats.

  Raises:
    QAFormatError: naming file, record and field, for any malformed record; naming the file for
      a directory, an empty file (or one without records) and text that is not UTF-8.
    FileNotFoundError: when the file does not exist.

  Example:
    >>> path = os.path.join(tempfile.mkdtemp(), "dev.jsonl")  # a FlashRAG-style record
    >>> _ = open(path, "w").write('{"id": "q1", "question": "Who?", "golden_answers": ["Ada"]}')
    >>> [(ex.id, ex.question, ex.answers, ex.source) for ex in load_qa(path)]
    [('q1', 'Who?', ('Ada',), 'flashrag')]
  """
  path = os.fspath(path)
  if not os.path.exists(path):
    raise FileNotFoundError(path)
  if os.path.isdir(path):
    raise QAFormatError(path, "is a directory; give the data file itself (.parquet, .json, "
                        ".jsonl or .csv)")
  if format is not None and format not in _PARSERS:
    raise ValueError(f"unknown QA format {format!r}; expected one of {FORMATS}")
  if os.path.getsize(path) == 0:
    raise QAFormatError(path, "the file is empty")
  stats = LoadStats(path=path, format=format or "")
  try:
    examples = _load_records(path, format, source, stats)
  except UnicodeDecodeError as e:
    raise QAFormatError(path, f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                        f"{e.start}); a binary file, or another encoding?") from None
  if not stats.records:
    raise QAFormatError(path, "no records in the file (only whitespace, an empty list or a header)")
  stats.kept = len(examples)
  if stats.skipped:
    logging.warning("%s: kept %d of %d records; skipped %d without answers and %d unanswerable",
                    path, stats.kept, stats.records, stats.skipped_no_answer,
                    stats.skipped_unanswerable)
  return (examples, stats) if return_stats else examples


def _load_records(path: str, format: str | None, source: str | None,
                  stats: LoadStats) -> list[QAExample]:
  examples: list[QAExample] = []
  parser = _PARSERS.get(format) if format else None
  for index, rec in _iter_records(path):
    if not isinstance(rec, dict):
      raise QAFormatError(path, f"expected a JSON object, got {type(rec).__name__}", record=index)
    if parser is None:
      stats.format = detect_format(rec.keys(), path)
      parser = _PARSERS[stats.format]
    stats.records += 1
    try:
      qid, question, answers, meta, rec_source = parser(rec, index)
    except _Skip as skip:
      if skip.reason == "unanswerable":
        stats.skipped_unanswerable += 1
      else:
        stats.skipped_no_answer += 1
      continue
    except _FieldError as e:
      raise QAFormatError(path, e.message, record=index, field=e.field) from None
    examples.append(QAExample(id=qid, question=question, answers=answers,
                              source=source or rec_source or stats.format, meta=meta))
  return examples
