"""What both sides of the retrieval HTTP API share: the JSON wire format, its errors and limits,
and a socket that bounds what one exchange may cost.

The format is Search-R1's (see `http_retriever`). Everything read here comes from the other side
and is treated as hostile: documents and scores are type-checked (a bad one is a `RetrieverError`,
never a TypeError from deep inside), previews of bad payloads are size- and depth-limited, and a
`BoundedSocket` enforces an overall deadline (not just a per-read timeout, which a peer dripping
one byte at a time resets forever) and a byte budget on everything received.
"""

from __future__ import annotations

import io
import json
import math
import reprlib
import socket
import time
from typing import Any

from trace_jax.envs.types import Doc

DEFAULT_PORT = 8000
# Bodies larger than this are refused: a batch of a few thousand queries is far below it.
MAX_BODY_BYTES = 32 * 1024 * 1024
# The server refuses more queries than this in one request (the client sends 64 by default).
MAX_QUERIES = 4096
# Neither side builds or reads an answer larger than this.
MAX_RESPONSE_BYTES = 64 * 1024 * 1024

_PREVIEW = reprlib.Repr()
_PREVIEW.maxlevel, _PREVIEW.maxstring, _PREVIEW.maxother = 4, 80, 80


class RetrieverError(RuntimeError):
  """The retrieval server answered, but with an error or a malformed response."""


class RetrieverUnavailableError(RetrieverError):
  """The retrieval server could not be reached (or kept failing) after all retries."""

  def __init__(self, url: str, attempts: int, cause: BaseException):
    self.url, self.attempts, self.cause = url, attempts, cause
    super().__init__(f"retrieval server at {url} unavailable after {attempts} attempt(s): "
                     f"{type(cause).__name__}: {cause}")


def preview(value: Any, limit: int = 200) -> str:
  """A short repr of a peer's value for an error message (bounded in size and nesting depth)."""
  return _PREVIEW.repr(value)[:limit]


# ----------------------------------------------------------------------------- wire format


def doc_to_json(doc: Doc) -> dict:
  """A Search-R1 document (`id`, `contents`) plus our exact `title` and `text`."""
  return {"id": doc.id, "contents": doc.contents, "title": doc.title, "text": doc.text}


def doc_from_json(document: Any, score: Any = 0.0) -> Doc:
  """Parses one document of a /retrieve answer (a dict, or a bare contents string); RetrieverError
  for anything else, or for a score that is not a finite number."""
  if isinstance(document, str):
    document = {"contents": document}
  if not isinstance(document, dict):
    raise RetrieverError(f"expected a document object, got {preview(document, 80)}")
  if isinstance(document.get("title"), str) and isinstance(document.get("text"), str):
    title, text = document["title"], document["text"]
  else:
    contents = document.get("contents")
    if not isinstance(contents, str):
      raise RetrieverError(f"document without string contents: {preview(document, 80)}")
    # Search-R1 corpora put the (often quoted) title on the first line of `contents`; split it the
    # way the local BM25 retriever does, so one corpus gives the same Docs locally and over HTTP.
    title, sep, text = contents.partition("\n")
    if sep:
      title, text = title.strip().strip('"'), text.strip()
    else:
      title, text = "", contents
  doc_id = document.get("id", "")
  if isinstance(doc_id, (dict, list)):
    raise RetrieverError(f"document id must be a string or a number, got {preview(doc_id, 80)}")
  return Doc(id=str(doc_id), title=title, text=text, score=_score(score))


def _score(score: Any) -> float:
  if isinstance(score, bool) or not isinstance(score, (int, float, str)):
    raise RetrieverError(f"score must be a number, got {preview(score, 80)}")
  try:
    value = float(score)
  except (ValueError, OverflowError):
    raise RetrieverError(f"score must be a number, got {preview(score, 80)}") from None
  if not math.isfinite(value):
    raise RetrieverError(f"score must be finite, got {preview(score, 80)}")
  return value


def results_from_json(payload: Any, n_queries: int) -> list[list[Doc]]:
  """Parses a /retrieve response body into one list of Docs per query."""
  result = payload.get("result") if isinstance(payload, dict) else None
  if not isinstance(result, list) or len(result) != n_queries:
    raise RetrieverError(f"expected {{'result': [...]}} with {n_queries} lists, got "
                         f"{preview(payload)}")
  out = []
  for hits in result:
    if not isinstance(hits, list):
      raise RetrieverError(f"expected a list of hits per query, got {preview(hits, 80)}")
    docs = []
    for hit in hits:
      if isinstance(hit, dict) and "document" in hit:
        docs.append(doc_from_json(hit["document"], hit.get("score", 0.0)))
      else:
        docs.append(doc_from_json(hit))
    out.append(docs)
  return out


class AnswerTooLarge(ValueError):
  """An answer that would exceed the byte limit (the server's 413)."""


def encode_results(results: list[list[Doc]], topk: int, return_scores: bool,
                   max_bytes: int) -> bytes:
  """`{"result": [...]}` as bytes, built query by query; stops as soon as it would exceed
  `max_bytes` (so an oversized answer is never built in full). At most `topk` hits per query."""
  parts, size = [], 20
  for docs in results:
    if return_scores:
      hits = [{"document": doc_to_json(d), "score": float(d.score)} for d in docs[:topk]]
    else:
      hits = [doc_to_json(d) for d in docs[:topk]]
    part = json_bytes(hits)
    size += len(part) + 2
    if size > max_bytes:
      raise AnswerTooLarge(f"the answer to {len(results)} queries with topk={topk} exceeds this "
                           f"server's limit of {max_bytes} bytes; ask for fewer queries or a "
                           f"smaller topk")
    parts.append(part)
  return b'{"result": [' + b", ".join(parts) + b"]}"


def json_bytes(value: Any) -> bytes:
  return json.dumps(value).encode("utf-8")


def loads_bounded(raw: bytes) -> Any:
  """`json.loads`, with nesting too deep for the parser (`[[[[...`) a ValueError like any other
  malformed JSON rather than a RecursionError."""
  try:
    return json.loads(raw)
  except RecursionError:
    raise ValueError("JSON nested too deeply") from None


# ----------------------------------------------------------------------------- bounded socket


class BudgetExceeded(OSError):
  """The peer sent more bytes than the exchange's budget."""


class BoundedSocket:
  """A socket wrapper for one side of an HTTP exchange: every receive and send waits at most
  until `deadline` (time.monotonic() seconds; each call's timeout is the time left, capped by the
  `settimeout` value), and receiving more than `budget` bytes in all raises BudgetExceeded.
  `set_deadline` / `set_budget` re-arm it (the server does so per request). Anything else is
  the wrapped socket's (`http.client` and `socketserver` use it as a socket)."""

  def __init__(self, sock, deadline: float = math.inf, budget: float = math.inf):
    self._sock, self._deadline, self._budget = sock, deadline, budget
    self._idle = sock.gettimeout()
    self._io_refs, self._closed = 0, False

  def set_deadline(self, deadline: float) -> None:
    self._deadline = deadline

  def set_budget(self, budget: float) -> None:
    self._budget = budget

  def settimeout(self, value) -> None:
    self._idle = value
    self._sock.settimeout(value)

  def gettimeout(self):
    return self._idle

  def _arm(self) -> None:
    left = self._deadline - time.monotonic()
    if left <= 0:
      raise TimeoutError("the exchange's deadline passed")
    self._sock.settimeout(left if self._idle is None else min(left, self._idle))

  def recv_into(self, buffer, nbytes: int = 0, flags: int = 0) -> int:
    self._arm()
    n = self._sock.recv_into(buffer, nbytes or memoryview(buffer).nbytes, flags)
    self._budget -= n
    if self._budget < 0:
      raise BudgetExceeded("the peer sent more bytes than this exchange allows")
    return n

  def recv(self, bufsize: int, flags: int = 0) -> bytes:
    buffer = bytearray(bufsize)
    n = self.recv_into(buffer, bufsize, flags)
    return bytes(buffer[:n])

  def sendall(self, data, flags: int = 0) -> None:
    self._arm()  # (since Python 3.5 the timeout bounds the whole sendall)
    self._sock.sendall(data, flags)

  def send(self, data, flags: int = 0) -> int:
    self._arm()
    return self._sock.send(data, flags)

  def makefile(self, mode: str = "r", buffering: int | None = None, **kw):
    if set(mode) - {"r", "w", "b"} or "b" not in mode or ("r" in mode) == ("w" in mode):
      raise ValueError(f"BoundedSocket.makefile supports 'rb' and 'wb', not {mode!r}")
    raw = socket.SocketIO(self, "r" if "r" in mode else "w")
    self._io_refs += 1
    if buffering == 0:
      return raw
    size = io.DEFAULT_BUFFER_SIZE if buffering in (None, -1) else buffering
    return io.BufferedReader(raw, size) if "r" in mode else io.BufferedWriter(raw, size)

  def _decref_socketios(self) -> None:
    self._io_refs -= 1
    if self._closed and self._io_refs <= 0:
      self._sock.close()

  def close(self) -> None:
    self._closed = True
    if self._io_refs <= 0:
      self._sock.close()

  def __getattr__(self, name):
    return getattr(self._sock, name)


__all__ = ["AnswerTooLarge", "BoundedSocket", "BudgetExceeded", "DEFAULT_PORT", "MAX_BODY_BYTES",
           "MAX_QUERIES", "MAX_RESPONSE_BYTES", "RetrieverError", "RetrieverUnavailableError",
           "doc_from_json", "doc_to_json", "encode_results", "json_bytes", "loads_bounded",
           "preview", "results_from_json"]
