"""Local BM25 retrieval with `bm25s` over a Search-R1 style jsonl corpus.

Corpus format (one JSON object a line): `{"id": "...", "contents": "Title\\ntext"}`; the title is
the first line of `contents`. Tokenization is deliberately plain (lowercase word characters, an
English stopword list, no stemming) so that query wording matters exactly as the synthetic world
expects: `founder` and `founded` are different terms.
"""

from __future__ import annotations

import json
import os
import re
from typing import Iterable, Sequence

import bm25s
import numpy as np

from trace_jax.envs.types import Doc
from trace_jax.fileio import atomic_write_json

_WORD_RE = re.compile(r"\w+", re.UNICODE)
STOPWORDS_EN = frozenset(bm25s.stopwords.STOPWORDS_EN)
_DOCS_FILE = "docs.jsonl"
_META_FILE = "retriever.json"
_INDEX_DIR = "bm25s_index"


def tokenize_for_bm25(text: str, stopwords: frozenset[str] = STOPWORDS_EN) -> list[str]:
  """Lowercased word tokens minus stopwords."""
  return [w for w in _WORD_RE.findall(text.lower()) if w not in stopwords]


def doc_from_contents(doc_id: str, contents: str) -> Doc:
  """Splits Search-R1 `contents` into title (first line) and text (the rest)."""
  title, sep, text = contents.partition("\n")
  if not sep:  # A single line: no separate title.
    return Doc(id=doc_id, title="", text=contents)
  return Doc(id=doc_id, title=title.strip().strip('"'), text=text.strip())


def load_corpus_jsonl(path: str) -> list[Doc]:
  """Reads a Search-R1 jsonl corpus. Malformed lines raise ValueError naming file and line."""
  docs = []
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, start=1):
      if not line.strip():
        continue
      where = f"{path}:{lineno}"
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
      if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
      if "contents" not in record or not isinstance(record["contents"], str):
        raise ValueError(f"{where}: missing string field 'contents'")
      doc_id = record.get("id", str(len(docs)))
      if not isinstance(doc_id, (str, int)):
        raise ValueError(f"{where}: field 'id' must be a string or integer")
      docs.append(doc_from_contents(str(doc_id), record["contents"]))
  return docs


def write_corpus_jsonl(docs: Iterable[Doc], path: str) -> None:
  """Writes docs in the same Search-R1 jsonl format that `load_corpus_jsonl` reads."""
  with open(path, "w", encoding="utf-8") as f:
    for d in docs:
      f.write(json.dumps({"id": d.id, "contents": d.contents}, ensure_ascii=False) + "\n")


SCORE_DECIMALS = 4  # scores that agree to this many decimals are ties


def top_k(scores: np.ndarray, k: int, decimals: int = SCORE_DECIMALS) -> np.ndarray:
  """Indices of the k best positive scores, best first; ties (scores equal to `decimals`
  decimals) go to the lower index.

  The same on every machine: the scores are rounded before they are compared, so that a last-bit
  difference in how a platform sums them cannot reorder them, and the order is decided by a
  stable sort, not by a partition whose tie order depends on the CPU's vector code paths (it
  does: the synthetic world's expert traces came out differently on two machines through exactly
  this). O(n) per query plus a sort of the candidates that reach the k-th rounded score.
  """
  q = np.round(np.asarray(scores, dtype=np.float64), decimals)
  if k < 1 or q.size == 0:
    return np.zeros((0,), np.int64)
  k = min(k, q.size)
  kth = np.partition(q, q.size - k)[q.size - k]  # a value, the same whatever the tie order
  cand = np.flatnonzero((q >= kth) & (q > 0))
  order = np.lexsort((cand, -q[cand]))  # by score descending, then index ascending
  return cand[order[:k]]


class BM25Retriever:
  """BM25 over an in-memory corpus; implements the `Retriever` protocol.

  Each query is scored over the whole corpus and its top k chosen by `top_k`, ties to the earlier
  passage, so results are the same on every machine. Hits with zero score (no query term in the
  passage) are dropped, so a result list may be shorter than k.
  """

  def __init__(self, docs: Sequence[Doc], k1: float = 1.5, b: float = 0.75, _index=None):
    if not docs:
      raise ValueError("BM25Retriever needs a non-empty corpus")
    self.docs = list(docs)
    self.k1, self.b = k1, b
    if _index is None:
      _index = bm25s.BM25(k1=k1, b=b)
      _index.index([tokenize_for_bm25(d.contents) for d in self.docs], show_progress=False)
    self._bm25 = _index

  @classmethod
  def from_docs(cls, docs: Sequence[Doc], **kwargs) -> "BM25Retriever":
    return cls(docs, **kwargs)

  @classmethod
  def from_jsonl(cls, path: str, **kwargs) -> "BM25Retriever":
    return cls(load_corpus_jsonl(path), **kwargs)

  def __len__(self) -> int:
    return len(self.docs)

  def search(self, queries: Sequence[str], k: int) -> list[list[Doc]]:
    """Top-k passages per query, best first, with `Doc.score` set."""
    if isinstance(queries, str):
      raise TypeError("search takes a sequence of queries, not a single string")
    if k < 1:
      raise ValueError(f"k must be >= 1, got {k}")
    if not queries:
      return []
    k_eff = min(k, len(self.docs))
    tokens = [tokenize_for_bm25(q) for q in queries]
    # bm25s cannot score an empty token list; such queries simply get no hits.
    nonempty = [i for i, t in enumerate(tokens) if t]
    results: list[list[Doc]] = [[] for _ in queries]
    if not nonempty:
      return results
    for qi in nonempty:
      ids = self._bm25.get_tokens_ids(tokens[qi])
      if not ids:  # every term unknown to the index
        continue
      scores = np.asarray(self._bm25.get_scores(ids), dtype=np.float64)
      for doc_idx in top_k(scores, k_eff):
        d = self.docs[int(doc_idx)]
        results[qi].append(Doc(id=d.id, title=d.title, text=d.text, score=float(scores[doc_idx])))
    return results

  def save(self, directory: str) -> None:
    """Writes the corpus (jsonl), the bm25s index and the parameters."""
    os.makedirs(directory, exist_ok=True)
    write_corpus_jsonl(self.docs, os.path.join(directory, _DOCS_FILE))
    self._bm25.save(os.path.join(directory, _INDEX_DIR))
    # The parameters last, atomically: a directory with them is complete.
    atomic_write_json(os.path.join(directory, _META_FILE),
                      {"k1": self.k1, "b": self.b, "n_docs": len(self.docs)})

  @classmethod
  def load(cls, directory: str) -> "BM25Retriever":
    meta_path = os.path.join(directory, _META_FILE)
    if not os.path.exists(meta_path):
      raise FileNotFoundError(f"{meta_path} not found: not a saved BM25Retriever directory")
    with open(meta_path) as f:
      meta = json.load(f)
    docs = load_corpus_jsonl(os.path.join(directory, _DOCS_FILE))
    if len(docs) != meta["n_docs"]:
      raise ValueError(f"{directory}: expected {meta['n_docs']} docs, found {len(docs)}")
    index = bm25s.BM25.load(os.path.join(directory, _INDEX_DIR))
    return cls(docs, k1=meta["k1"], b=meta["b"], _index=index)

