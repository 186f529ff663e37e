"""Search-R1's retrieval HTTP API, both sides: `HTTPRetriever` (client) and `serve` (server).

The wire format is the one Search-R1's retrieval server speaks, so each side works with the other:

  POST {url}/retrieve  {"queries": ["q1", ...], "topk": 3, "return_scores": true}
  ->  {"result": [[{"document": {"id": "7", "contents": "Title\\ntext"}, "score": 12.3}, ...], ...]}

With `"return_scores": false` each result is the bare document. Our server also sends `title` and
`text` in each document so `Doc`s survive the round trip exactly; other servers' documents are split
at the first newline of `contents` (title first, surrounding quotes dropped), as our BM25 retriever
reads a Search-R1 corpus. `GET /health`
answers `{"status": "ok", ...}`.

Both sides are bounded. The client's time per request is at most about
`timeout_s * (max_retries + 1)` plus the backoff sleeps (`worst_case_s`), it never sends a body
larger than `max_request_bytes` (it splits the batch instead), never reads more than
`max_response_bytes`, and keeps at most `k` documents per query whatever the server sends. The
server answers 413 with a message for too many queries in one request (`max_queries`), for a body
over `MAX_BODY_BYTES` and for an answer that would exceed `max_response_bytes`; it never builds an
unbounded response.

Standard library only: the client runs in every rollout worker, the server in a small side process.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import http.server
import json
import logging
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Sequence

from trace_jax.envs.types import Doc
from trace_jax.envs.types import Retriever

DEFAULT_PORT = 8000
# Bodies larger than this are refused: a batch of a few thousand queries is far below it.
MAX_BODY_BYTES = 32 * 1024 * 1024
# The server refuses more queries than this in one request (the client sends 64 by default).
MAX_QUERIES = 4096
# Neither side builds or reads an answer larger than this.
MAX_RESPONSE_BYTES = 64 * 1024 * 1024


class RetrieverError(RuntimeError):
  """The retrieval server answered, but with an error or a malformed response."""


class RetrieverUnavailableError(RetrieverError):
  """The retrieval server could not be reached (or kept failing) after all retries."""

  def __init__(self, url: str, attempts: int, cause: BaseException):
    self.url, self.attempts, self.cause = url, attempts, cause
    super().__init__(f"retrieval server at {url} unavailable after {attempts} attempt(s): "
                     f"{type(cause).__name__}: {cause}")


# ----------------------------------------------------------------------------- wire format


def doc_to_json(doc: Doc) -> dict:
  """A Search-R1 document (`id`, `contents`) plus our exact `title` and `text`."""
  return {"id": doc.id, "contents": doc.contents, "title": doc.title, "text": doc.text}


def doc_from_json(document: Any, score: float = 0.0) -> Doc:
  """Parses one document of a /retrieve answer (a dict, or a bare contents string)."""
  if isinstance(document, str):
    document = {"contents": document}
  if not isinstance(document, dict):
    raise RetrieverError(f"expected a document object, got {document!r:.80}")
  if isinstance(document.get("title"), str) and isinstance(document.get("text"), str):
    title, text = document["title"], document["text"]
  else:
    contents = document.get("contents")
    if not isinstance(contents, str):
      raise RetrieverError(f"document without string contents: {document!r:.80}")
    # Search-R1 corpora put the (often quoted) title on the first line of `contents`; split it the
    # way the local BM25 retriever does, so one corpus gives the same Docs locally and over HTTP.
    title, sep, text = contents.partition("\n")
    if sep:
      title, text = title.strip().strip('"'), text.strip()
    else:
      title, text = "", contents
  return Doc(id=str(document.get("id", "")), title=title, text=text, score=float(score))


def results_from_json(payload: Any, n_queries: int) -> list[list[Doc]]:
  """Parses a /retrieve response body into one list of Docs per query."""
  result = payload.get("result") if isinstance(payload, dict) else None
  if not isinstance(result, list) or len(result) != n_queries:
    raise RetrieverError(f"expected {{'result': [...]}} with {n_queries} lists, got "
                         f"{json.dumps(payload)[:200]}")
  out = []
  for hits in result:
    if not isinstance(hits, list):
      raise RetrieverError(f"expected a list of hits per query, got {hits!r:.80}")
    docs = []
    for hit in hits:
      if isinstance(hit, dict) and "document" in hit:
        docs.append(doc_from_json(hit["document"], hit.get("score", 0.0)))
      else:
        docs.append(doc_from_json(hit))
    out.append(docs)
  return out


# ----------------------------------------------------------------------------- client


class HTTPRetriever:
  """A `Retriever` backed by a Search-R1-compatible `/retrieve` server.

  Large query lists are split into batches of `batch_size` (one POST each, sent by up to
  `concurrency` threads); a batch whose body would exceed `max_request_bytes` is split further.
  Connection failures, timeouts and 5xx/429 answers are retried with exponential backoff
  (`backoff_s`, doubling, capped at `max_backoff_s`); after `max_retries` retries a
  `RetrieverUnavailableError` names the URL. Other 4xx answers (400, 404, 413, ...) raise
  `RetrieverError` with the server's message at once, since repeating a bad request cannot help.

  A hung server costs one request at most `worst_case_s` seconds: `timeout_s` bounds the
  connection, every read and the whole body read of each attempt. At most `k` documents per query
  are kept, and an answer larger than `max_response_bytes` is an error (not retried).

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
    handlers = [] if use_env_proxy else [urllib.request.ProxyHandler({})]
    self._opener = urllib.request.build_opener(*handlers)
    self._stats_lock = threading.Lock()
    self._stats = _zero_stats()

  def __repr__(self) -> str:
    return f"HTTPRetriever({self.url!r}, batch_size={self.batch_size})"

  def worst_case_s(self, retries: int | None = None) -> float:
    """Upper bound (network stalls aside) of one request's time against a hung server."""
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
      try:
        with self._opener.open(request, timeout=self.timeout_s) as response:
          raw = self._read(response, t0, url)
      except urllib.error.HTTPError as e:
        message = _error_message(e)
        self._timed(t0)
        if e.code >= 500 or e.code == 429:
          last = RetrieverError(f"HTTP {e.code}: {message}")
          continue
        self._count(errors=1)
        raise _ClientError(f"{method} {url} failed with HTTP {e.code}: {message}") from None
      except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
        # Refused or reset connections, timeouts, servers that hang up mid-answer.
        self._timed(t0)
        if _is_timeout(e):
          self._count(timeouts=1)
        last = e
        continue
      self._timed(t0)
      try:
        return json.loads(raw)
      except ValueError:
        # A torn or garbled body from a flaky server or proxy: as transient as a 5xx, retried.
        last = RetrieverError(f"{method} {url} returned non-JSON: {raw[:200]!r}")
        continue
    self._count(errors=1)
    raise _Unavailable(url, retries + 1, last)

  def _read(self, response, t0: float, url: str) -> bytes:
    """The body, read in chunks so that neither a trickling server (past `timeout_s` in all) nor
    a huge answer (past `max_response_bytes`) can hold the caller."""
    length = response.headers.get("Content-Length")
    if length is not None and length.isdigit() and int(length) > self.max_response_bytes:
      self._count(errors=1)
      raise _ClientError(f"{url} answered {length} bytes, over max_response_bytes="
                         f"{self.max_response_bytes}; ask for fewer queries or a smaller topk")
    chunks, size = [], 0
    while True:
      chunk = response.read1(1 << 16)  # One recv at most: a trickle cannot stretch it.
      if not chunk:
        return b"".join(chunks)
      chunks.append(chunk)
      size += len(chunk)
      if size > self.max_response_bytes:
        self._count(errors=1)
        raise _ClientError(f"{url} answered more than max_response_bytes="
                           f"{self.max_response_bytes} bytes")
      if time.monotonic() - t0 > self.timeout_s:
        raise TimeoutError(f"reading the answer took over timeout_s={self.timeout_s}s")

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


def _error_message(error: urllib.error.HTTPError) -> str:
  try:
    return json.loads(error.read()).get("error", "")
  except Exception:  # A non-JSON error page: the reason phrase will do.
    return str(error.reason)


# ----------------------------------------------------------------------------- server


class _BadRequest(ValueError):
  pass


def _parse_retrieve(body: Any, max_topk: int) -> tuple[list[str], int, bool]:
  if not isinstance(body, dict):
    raise _BadRequest("request body must be a JSON object")
  queries = body.get("queries")
  if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
    raise _BadRequest("'queries' must be a list of strings")
  topk = body.get("topk", 3)  # Search-R1's default.
  if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= max_topk:
    raise _BadRequest(f"'topk' must be an integer in [1, {max_topk}]")
  return_scores = body.get("return_scores", False)
  if not isinstance(return_scores, bool):
    raise _BadRequest("'return_scores' must be a boolean")
  return queries, topk, return_scores


class _Handler(http.server.BaseHTTPRequestHandler):
  server: RetrievalServer
  protocol_version = "HTTP/1.1"  # Keep-alive: clients send many batches in a row.

  def log_message(self, format, *args):  # noqa: A002 - the base class's signature.
    logging.debug("retrieval server: " + format, *args)

  def _send(self, status: int, payload: Any) -> None:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode("utf-8")
    self.send_response(status)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(data)

  def _drain(self, n: int) -> None:
    deadline = time.monotonic() + _DRAIN_SECONDS
    while n > 0 and time.monotonic() < deadline:
      chunk = self.rfile.read(min(n, 1 << 20))
      if not chunk:
        return
      n -= len(chunk)

  def do_GET(self):  # noqa: N802 - http.server's naming.
    if self.path.rstrip("/") == "/health":
      self._send(200, {"status": "ok", "retriever": type(self.server.retriever).__name__,
                       **self.server.counts()})
    else:
      self._send(404, {"error": f"no route GET {self.path}; try /health or POST /retrieve"})

  def do_POST(self):  # noqa: N802
    if self.path.rstrip("/") != "/retrieve":
      self._send(404, {"error": f"no route POST {self.path}; use /retrieve"})
      return
    try:
      length = int(self.headers.get("Content-Length") or -1)
    except ValueError:
      length = -1
    if length < 0:
      self.close_connection = True
      self._send(411, {"error": "a Content-Length header is required"})
      return
    limit = self.server.max_body_bytes
    if length > limit:
      self.close_connection = True  # Whatever stays unread would corrupt the next request.
      # Clients send the whole body before reading the answer: read (and drop) a moderately
      # oversized one so that the client sees this 413 rather than a reset connection, which it
      # would take for an outage and retry.
      if length <= _DRAIN_FACTOR * limit:
        self._drain(length)
      self._send(413, {"error": f"body of {length} bytes exceeds this server's limit of {limit} "
                                f"bytes; send fewer queries per request"})
      return
    raw = self.rfile.read(length)
    try:
      queries, topk, return_scores = _parse_retrieve(json.loads(raw), self.server.max_topk)
    except (_BadRequest, ValueError) as e:
      message = str(e) if isinstance(e, _BadRequest) else f"invalid JSON: {e}"
      self._send(400, {"error": message})
      return
    if len(queries) > self.server.max_queries:
      self._send(413, {"error": f"{len(queries)} queries in one request exceed this server's "
                                f"limit of {self.server.max_queries}; send smaller batches "
                                f"(HTTPRetriever batch_size, config retriever.batch_size)"})
      return
    try:
      results = self.server.search(queries, topk)
    except Exception as e:  # Report the retriever's failure to the client instead of hanging up.
      logging.exception("retrieval failed")
      self._send(500, {"error": f"retriever failed: {type(e).__name__}: {e}"})
      return
    try:
      data = _encode_results(results, topk, return_scores, self.server.max_response_bytes)
    except _TooLarge as e:
      self._send(413, {"error": str(e)})
      return
    self._send(200, data)


# An oversized body up to this multiple of the limit is read and dropped (for at most
# _DRAIN_SECONDS) before the 413 goes out; a larger one gets the 413 and a closed connection.
_DRAIN_FACTOR = 16
_DRAIN_SECONDS = 10.0


class _TooLarge(ValueError):
  pass


def _encode_results(results: list[list[Doc]], topk: int, return_scores: bool,
                    max_bytes: int) -> bytes:
  """`{"result": [...]}` as bytes, built query by query; stops as soon as it would exceed
  `max_bytes` (so an oversized answer is never built in full). At most `topk` hits per query."""
  parts, size = [], 20
  for docs in results:
    if return_scores:
      hits = [{"document": doc_to_json(d), "score": float(d.score)} for d in docs[:topk]]
    else:
      hits = [doc_to_json(d) for d in docs[:topk]]
    part = json.dumps(hits).encode("utf-8")
    size += len(part) + 2
    if size > max_bytes:
      raise _TooLarge(f"the answer to {len(results)} queries with topk={topk} exceeds this "
                      f"server's limit of {max_bytes} bytes; ask for fewer queries or a smaller "
                      f"topk")
    parts.append(part)
  return b'{"result": [' + b", ".join(parts) + b"]}"


class RetrievalServer(http.server.ThreadingHTTPServer):
  """A threaded HTTP server answering /retrieve from a local `Retriever`.

  Requests with more than `max_queries` queries, a body over `max_body_bytes`, or an answer that
  would exceed `max_response_bytes` get a 413 with a message.

  Attributes:
    url: "http://host:port", with the port actually bound (useful with port 0).
    requests, queries: how many /retrieve requests and queries were answered (tests count
      batches with these).
  """

  daemon_threads = True
  allow_reuse_address = True

  def __init__(self, retriever: Retriever, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
               max_topk: int = 1000, max_queries: int = MAX_QUERIES,
               max_response_bytes: int = MAX_RESPONSE_BYTES, max_body_bytes: int = MAX_BODY_BYTES):
    if max_topk < 1 or max_queries < 1 or min(max_response_bytes, max_body_bytes) < 1024:
      raise ValueError("max_topk and max_queries must be >= 1, max_response_bytes and "
                       "max_body_bytes >= 1024")
    self.retriever, self.max_topk = retriever, max_topk
    self.max_queries, self.max_response_bytes = max_queries, max_response_bytes
    self.max_body_bytes = max_body_bytes
    self.requests = self.queries = 0
    # Retrievers promise no thread safety; HTTP parsing stays concurrent, searches take turns.
    self._search_lock = threading.Lock()
    self._count_lock = threading.Lock()
    self._thread: threading.Thread | None = None
    super().__init__((host, port), _Handler)

  @property
  def port(self) -> int:
    return self.server_address[1]

  @property
  def url(self) -> str:
    return f"http://{self.server_address[0]}:{self.port}"

  def handle_error(self, request, client_address) -> None:
    """Logs instead of printing; a client that gave up (timeout) and hung up is routine."""
    error = sys.exc_info()[1]
    if isinstance(error, ConnectionError):
      logging.debug("retrieval server: client %s went away: %s", client_address, error)
    else:
      logging.exception("retrieval server: error serving %s", client_address)

  def counts(self) -> dict:
    with self._count_lock:
      return {"requests": self.requests, "queries": self.queries}

  def search(self, queries: list[str], k: int) -> list[list[Doc]]:
    with self._count_lock:
      self.requests += 1
      self.queries += len(queries)
    if not queries:
      return []
    with self._search_lock:
      results = self.retriever.search(queries, k)
    if len(results) != len(queries):
      raise RuntimeError(f"retriever returned {len(results)} lists for {len(queries)} queries")
    return results

  def start(self) -> "RetrievalServer":
    """Serves in a daemon thread; returns self."""
    # A short poll interval makes close() return quickly; the idle cost is negligible.
    self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05},
                                    name="retrieval-server", daemon=True)
    self._thread.start()
    return self

  def close(self) -> None:
    """Stops serving and frees the port."""
    if self._thread is not None:
      self.shutdown()
      self._thread.join()
      self._thread = None
    self.server_close()

  def __enter__(self) -> "RetrievalServer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def serve(retriever: Retriever, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *,
          start: bool = True, max_topk: int = 1000, max_queries: int = MAX_QUERIES,
          max_response_bytes: int = MAX_RESPONSE_BYTES,
          max_body_bytes: int = MAX_BODY_BYTES) -> RetrievalServer:
  """Binds a `RetrievalServer` for `retriever` (port 0 picks a free port).

  With `start` (the default) it already serves from a daemon thread; otherwise call
  `server.serve_forever()` yourself. Stop it with `server.close()` or a `with` block.
  """
  server = RetrievalServer(retriever, host, port, max_topk=max_topk, max_queries=max_queries,
                           max_response_bytes=max_response_bytes, max_body_bytes=max_body_bytes)
  return server.start() if start else server


__all__ = ["DEFAULT_PORT", "HTTPRetriever", "MAX_BODY_BYTES", "MAX_QUERIES", "MAX_RESPONSE_BYTES",
           "RetrievalServer", "RetrieverError", "RetrieverUnavailableError", "doc_from_json",
           "doc_to_json", "results_from_json", "serve"]
