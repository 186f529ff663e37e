"""Search-R1's retrieval HTTP API: `HTTPRetriever` (the client), with the server (`serve`,
`RetrievalServer`: `retrieval_server`) and the wire format (`retrieval_wire`) re-exported here.

The wire format is the one Search-R1's retrieval server speaks, so each side works with the other:

  POST {url}/retrieve  {"queries": ["q1", ...], "topk": 3, "return_scores": true}
  ->  {"result": [[{"document": {"id": "7", "contents": "Title\\ntext"}, "score": 12.3}, ...], ...]}

With `"return_scores": false` each result is the bare document. Our server also sends `title` and
`text` in each document so `Doc`s survive the round trip exactly; other servers' documents are split
at the first newline of `contents` (title first, surrounding quotes dropped), as our BM25 retriever
reads a Search-R1 corpus. `GET /health` answers `{"status": "ok", ...}`.

Both sides are bounded and treat the other as hostile. The client's time per request is at most
about `timeout_s * (max_retries + 1)` plus the backoff sleeps (`worst_case_s`): each attempt has
`timeout_s` in all for connecting, sending, and reading the headers and the body, however slowly
the server drips them. It never sends a body larger than `max_request_bytes` (it splits the batch
instead), never reads more than `max_response_bytes` (body, error body or headers), follows no
redirect (a 3xx is an error naming where it pointed), and keeps at most `k` documents per query
whatever the server sends; a malformed answer (a document or score of the wrong type included) is
a `RetrieverError`. The server's bounds: `retrieval_server`.

Standard library only: the client runs in every rollout worker, the server in a small side process.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from typing import Sequence

from trace_jax.envs.retrieval.server import (MAX_QUERY_CHARS, MAX_WORKERS, TIMEOUT_S,
                                             RetrievalServer, serve)
from trace_jax.envs.retrieval.wire import (DEFAULT_PORT, MAX_BODY_BYTES, MAX_QUERIES,
                                           MAX_RESPONSE_BYTES, BoundedSocket, BudgetExceeded,
                                           RetrieverError, RetrieverUnavailableError,
                                           doc_from_json, doc_to_json, loads_bounded, preview,
                                           results_from_json)
from trace_jax.envs.types import Doc

# Bytes of headers (and read-ahead) received beyond `max_response_bytes` before the answer counts
# as oversized; error bodies are read up to this many bytes for their message.
_HEADER_BYTES = 64 * 1024


# ----------------------------------------------------------------------------- client


class HTTPRetriever:
  """A `Retriever` backed by a Search-R1-compatible `/retrieve` server.

  Large query lists are split into batches of `batch_size` (one POST each, sent by up to
  `concurrency` threads); a batch whose body would exceed `max_request_bytes` is split further.
  Connection failures, timeouts and 5xx/429 answers are retried with exponential backoff
  (`backoff_s`, doubling, capped at `max_backoff_s`); after `max_retries` retries a
  `RetrieverUnavailableError` names the URL. Other 4xx answers (400, 404, 413, ...) raise
  `RetrieverError` with the server's message at once, since repeating a bad request cannot help.

  A hung server costs one request at most `worst_case_s` seconds: `timeout_s` bounds each attempt
  in all (connecting, sending, the headers and the body, however slowly they trickle in). At most
  `k` documents per query are kept; an answer (headers and error bodies included) larger than
  `max_response_bytes` and a redirect (not followed, whichever host it names) are errors, not
  retried.

  `stats(reset=...)` reports requests, retries, timeouts, errors and per-attempt latency.
  """

  def __init__(self, url: str, *, batch_size: int = 64, timeout_s: float = 10.0,
               max_retries: int = 2, backoff_s: float = 0.5, max_backoff_s: float = 4.0,
               concurrency: int = 1, use_env_proxy: bool = False,
               max_request_bytes: int = MAX_BODY_BYTES,
               max_response_bytes: int = MAX_RESPONSE_BYTES):
    if batch_size < 1 or concurrency < 1 or max_retries < 0:
      raise ValueError("batch_size and concurrency must be >= 1, max_retries >= 0")
    if not timeout_s > 0 or backoff_s < 0 or max_backoff_s < 0:
      raise ValueError(f"timeout_s must be > 0 and backoffs >= 0, got timeout_s={timeout_s}, "
                       f"backoff_s={backoff_s}, max_backoff_s={max_backoff_s}")
    if max_request_bytes < 1024 or max_response_bytes < 1024:
      raise ValueError("max_request_bytes and max_response_bytes must be >= 1024")
    url = url.rstrip("/")
    # Accept Search-R1's config style, which names the endpoint itself.
    self.url = url[: -len("/retrieve")] if url.endswith("/retrieve") else url
    self.batch_size, self.timeout_s, self.concurrency = batch_size, timeout_s, concurrency
    self.max_retries, self.backoff_s, self.max_backoff_s = max_retries, backoff_s, max_backoff_s
    self.max_request_bytes, self.max_response_bytes = max_request_bytes, max_response_bytes
    # Retrieval servers run beside the trainer; a cluster-wide HTTP proxy from the environment
    # would otherwise capture (and usually break) that local traffic.
    self._proxy_handlers = [] if use_env_proxy else [urllib.request.ProxyHandler({})]
    self._stats_lock = threading.Lock()
    self._stats = _zero_stats()

  def __repr__(self) -> str:
    return f"HTTPRetriever({self.url!r}, batch_size={self.batch_size})"

  def worst_case_s(self, retries: int | None = None) -> float:
    """Upper bound of one request's time against a hung or trickling server (a slow DNS lookup
    of the URL's host aside)."""
    retries = self.max_retries if retries is None else retries
    sleeps = sum(min(self.backoff_s * 2 ** i, self.max_backoff_s) for i in range(retries))
    return self.timeout_s * (retries + 1) + sleeps

  def stats(self, reset: bool = False) -> dict:
    """Counts since the last reset: `requests` (HTTP attempts), `retries`, `timeouts`, `errors`
    (requests given up on: unavailable, 4xx or malformed), `latency_mean_s` / `latency_max_s`
    (per attempt, failed ones included)."""
    with self._stats_lock:
      s = dict(self._stats)
      if reset:
        self._stats = _zero_stats()
    n = s.pop("latency_n")
    s["latency_mean_s"] = s.pop("latency_sum_s") / n if n else 0.0
    return s

  def search(self, queries: Sequence[str], k: int) -> list[list[Doc]]:
    """Top-`k` documents for each query, in query order (never more than `k` per query)."""
    if isinstance(queries, str):
      raise TypeError("queries must be a sequence of strings, not one string")
    queries = list(queries)
    if not all(isinstance(q, str) for q in queries):
      raise TypeError("every query must be a string")
    if int(k) != k or k < 1:
      raise ValueError(f"k must be a positive integer, got {k!r}")
    batches = [queries[i:i + self.batch_size] for i in range(0, len(queries), self.batch_size)]
    if self.concurrency == 1 or len(batches) <= 1:
      results = [self._search_batch(b, int(k)) for b in batches]
    else:
      with concurrent.futures.ThreadPoolExecutor(min(self.concurrency, len(batches))) as pool:
        results = list(pool.map(lambda b: self._search_batch(b, int(k)), batches))
    return [docs[:int(k)] for batch in results for docs in batch]

  def health(self, retries: int | None = None) -> dict:
    """The server's /health answer (raises like `search` when unreachable). `retries` defaults to
    `max_retries`; a start-up check passes a small number to fail fast."""
    return self._request("GET", "/health", None, retries)

  def _search_batch(self, queries: list[str], k: int) -> list[list[Doc]]:
    body = _encode_body({"queries": queries, "topk": k, "return_scores": True})
    if len(body) > self.max_request_bytes:
      if len(queries) == 1:
        self._count(errors=1)
        raise RetrieverError(f"one query of {len(queries[0])} characters makes a request of "
                             f"{len(body)} bytes, over max_request_bytes={self.max_request_bytes}")
      half = len(queries) // 2  # Split rather than send a body the server would refuse.
      return self._search_batch(queries[:half], k) + self._search_batch(queries[half:], k)
    try:
      return results_from_json(self._request("POST", "/retrieve", body), len(queries))
    except RetrieverError as e:
      if not isinstance(e, _Counted):
        self._count(errors=1)
      raise

  def _count(self, **kw) -> None:
    with self._stats_lock:
      for key, v in kw.items():
        if key == "latency_max_s":
          self._stats[key] = max(self._stats[key], v)
        else:
          self._stats[key] += v

  def _request(self, method: str, path: str, body: bytes | None, retries: int | None = None):
    url = self.url + path
    retries = self.max_retries if retries is None else retries
    headers = {"Content-Type": "application/json"} if body is not None else {}
    last: BaseException | None = None
    for attempt in range(retries + 1):
      if attempt:
        self._count(retries=1)
        time.sleep(min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s))
      request = urllib.request.Request(url, data=body, headers=headers, method=method)
      t0 = time.monotonic()
      deadline = t0 + self.timeout_s
      try:
        with self._opener(deadline).open(request, timeout=self.timeout_s) as response:
          raw = self._read(response, deadline, url)
      except urllib.error.HTTPError as e:
        message = self._error_message(e, deadline)
        self._timed(t0)
        if e.code >= 500 or e.code == 429:
          last = RetrieverError(f"HTTP {e.code}: {message}")
          continue
        self._count(errors=1)
        if 300 <= e.code < 400:
          raise _ClientError(f"{method} {url} answered HTTP {e.code}, a redirect to "
                             f"{preview(e.headers.get('Location'), 200)}; the client follows no "
                             f"redirects (point retriever.url at the server itself)") from None
        raise _ClientError(f"{method} {url} failed with HTTP {e.code}: {message}") from None
      except BudgetExceeded:
        self._timed(t0)
        self._count(errors=1)
        raise _ClientError(f"{url} sent more than max_response_bytes={self.max_response_bytes} "
                           f"bytes (with its headers)") from None
      except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
        # Refused or reset connections, timeouts, servers that hang up mid-answer.
        self._timed(t0)
        if _is_timeout(e):
          self._count(timeouts=1)
        last = e
        continue
      self._timed(t0)
      try:
        return loads_bounded(raw)
      except ValueError:
        # A torn or garbled body from a flaky server or proxy: as transient as a 5xx, retried.
        last = RetrieverError(f"{method} {url} returned non-JSON: {raw[:200]!r}")
        continue
    self._count(errors=1)
    raise _Unavailable(url, retries + 1, last)

  def _opener(self, deadline: float) -> urllib.request.OpenerDirector:
    """An opener whose connections keep to `deadline` and the byte budget, and that follows no
    redirect (a 3xx comes back as an HTTPError)."""
    budget = self.max_response_bytes + _HEADER_BYTES
    return urllib.request.build_opener(
        *self._proxy_handlers, _NoRedirect(), _BoundedHTTPHandler(deadline, budget),
        _BoundedHTTPSHandler(deadline, budget))

  def _read(self, response, deadline: float, url: str, limit: int | None = None) -> bytes:
    """The body, read in chunks so that neither a trickling server (past the attempt's deadline)
    nor a huge answer (past `max_response_bytes`) can hold the caller. With `limit` (error
    bodies), the first `limit` bytes, the rest left unread."""
    if limit is None:
      length = response.headers.get("Content-Length")
      if length is not None and length.isdigit() and int(length) > self.max_response_bytes:
        self._count(errors=1)
        raise _ClientError(f"{url} answered {length} bytes, over max_response_bytes="
                           f"{self.max_response_bytes}; ask for fewer queries or a smaller topk")
    chunks, size = [], 0
    while limit is None or size < limit:
      if time.monotonic() > deadline:
        raise TimeoutError(f"reading the answer took over timeout_s={self.timeout_s}s")
      chunk = response.read1(1 << 16 if limit is None else min(1 << 16, limit - size))
      if not chunk:
        break
      chunks.append(chunk)
      size += len(chunk)
      if limit is None and size > self.max_response_bytes:
        self._count(errors=1)
        raise _ClientError(f"{url} answered more than max_response_bytes="
                           f"{self.max_response_bytes} bytes")
    return b"".join(chunks)

  def _error_message(self, error: urllib.error.HTTPError, deadline: float) -> str:
    """The `error` field of an error answer's JSON body (its first bytes only, read within the
    attempt's deadline), else the reason phrase."""
    try:
      raw = self._read(error, deadline, error.filename, limit=min(self.max_response_bytes,
                                                                 _HEADER_BYTES))
      message = loads_bounded(raw).get("error", "")
      return message[:1000] if isinstance(message, str) else preview(message)
    except Exception:  # A non-JSON, cut or unreadable error page: the reason phrase will do.
      return str(error.reason)[:200]
    finally:
      if error.fp is not None:
        error.close()

  def _timed(self, t0: float) -> None:
    dt = time.monotonic() - t0
    self._count(requests=1, latency_n=1, latency_sum_s=dt, latency_max_s=dt)


def _zero_stats() -> dict:
  return {"requests": 0, "retries": 0, "timeouts": 0, "errors": 0, "latency_n": 0,
          "latency_sum_s": 0.0, "latency_max_s": 0.0}


class _Counted:
  """Marks errors already counted in the client's stats."""


class _ClientError(RetrieverError, _Counted):
  pass


class _Unavailable(RetrieverUnavailableError, _Counted):
  pass


def _is_timeout(error: BaseException) -> bool:
  reason = getattr(error, "reason", error)
  return isinstance(reason, TimeoutError) or "timed out" in str(error)


def _encode_body(body: dict) -> bytes:
  return json.dumps(body).encode("utf-8")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
  """Follows no redirect: the 3xx comes back as an HTTPError (`_request` names its target)."""

  def redirect_request(self, req, fp, code, msg, headers, newurl):
    return None


class _BoundedConnection:
  """An http.client connection (mixin) that connects within `deadline` and reads and writes
  through a `BoundedSocket` (the deadline and a byte budget for everything received)."""

  deadline: float
  budget: float

  def connect(self) -> None:
    self.timeout = max(1e-3, self.deadline - time.monotonic())
    super().connect()
    self.sock = BoundedSocket(self.sock, self.deadline, self.budget)


class _BoundedHTTPConnection(_BoundedConnection, http.client.HTTPConnection):
  pass


class _BoundedHTTPSConnection(_BoundedConnection, http.client.HTTPSConnection):
  pass


class _BoundedHTTPHandler(urllib.request.HTTPHandler):
  def __init__(self, deadline: float, budget: float):
    super().__init__()
    self.deadline, self.budget = deadline, budget

  def _connection(self, host, **kw):
    conn = self.connection_class(host, **kw)
    conn.deadline, conn.budget = self.deadline, self.budget
    return conn

  connection_class = _BoundedHTTPConnection

  def http_open(self, req):
    return self.do_open(self._connection, req)


class _BoundedHTTPSHandler(urllib.request.HTTPSHandler):
  def __init__(self, deadline: float, budget: float):
    super().__init__()
    self.deadline, self.budget = deadline, budget

  connection_class = _BoundedHTTPSConnection
  _connection = _BoundedHTTPHandler._connection

  def https_open(self, req):
    kw = {"context": self._context}
    if getattr(self, "_check_hostname", None) is not None:  # (Python < 3.12)
      kw["check_hostname"] = self._check_hostname
    return self.do_open(self._connection, req, **kw)


__all__ = ["DEFAULT_PORT", "HTTPRetriever", "MAX_BODY_BYTES", "MAX_QUERIES", "MAX_QUERY_CHARS",
           "MAX_RESPONSE_BYTES", "MAX_WORKERS", "RetrievalServer", "RetrieverError",
           "RetrieverUnavailableError", "TIMEOUT_S", "doc_from_json", "doc_to_json",
           "results_from_json", "serve"]
