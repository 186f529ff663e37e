"""Search-R1's retrieval HTTP API, both sides: `HTTPRetriever` (client) and `serve` (server).

The wire format is the one Search-R1's retrieval server speaks, so each side works with the other:

  POST {url}/retrieve  {"queries": ["q1", ...], "topk": 3, "return_scores": true}
  ->  {"result": [[{"document": {"id": "7", "contents": "Title\\ntext"}, "score": 12.3}, ...], ...]}

With `"return_scores": false` each result is the bare document. Our server also sends `title` and
`text` in each document so `Doc`s survive the round trip exactly; other servers' documents are split
at the first newline of `contents` (title first, surrounding quotes dropped), as our BM25 retriever
reads a Search-R1 corpus. `GET /health`
answers `{"status": "ok", ...}`.

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
  `concurrency` threads). Connection failures, timeouts and 5xx/429 answers are retried with
  exponential backoff (`backoff_s`, doubling, capped at `max_backoff_s`); after `max_retries`
  retries a `RetrieverUnavailableError` names the URL. Other 4xx answers raise `RetrieverError`
  with the server's message at once, since repeating a bad request cannot help.
  """

  def __init__(self, url: str, *, batch_size: int = 64, timeout_s: float = 30.0,
               max_retries: int = 4, backoff_s: float = 0.5, max_backoff_s: float = 8.0,
               concurrency: int = 1, use_env_proxy: bool = False):
    if batch_size < 1 or concurrency < 1 or max_retries < 0:
      raise ValueError("batch_size and concurrency must be >= 1, max_retries >= 0")
    url = url.rstrip("/")
    # Accept Search-R1's config style, which names the endpoint itself.
    self.url = url[: -len("/retrieve")] if url.endswith("/retrieve") else url
    self.batch_size, self.timeout_s, self.concurrency = batch_size, timeout_s, concurrency
    self.max_retries, self.backoff_s, self.max_backoff_s = max_retries, backoff_s, max_backoff_s
    # Retrieval servers run beside the trainer; a cluster-wide HTTP proxy from the environment
    # would otherwise capture (and usually break) that local traffic.
    handlers = [] if use_env_proxy else [urllib.request.ProxyHandler({})]
    self._opener = urllib.request.build_opener(*handlers)

  def __repr__(self) -> str:
    return f"HTTPRetriever({self.url!r}, batch_size={self.batch_size})"

  def search(self, queries: Sequence[str], k: int) -> list[list[Doc]]:
    """Top-`k` documents for each query, in query order."""
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
    return [docs for batch in results for docs in batch]

  def health(self) -> dict:
    """The server's /health answer (raises like `search` when unreachable)."""
    return self._request("GET", "/health", None)

  def _search_batch(self, queries: list[str], k: int) -> list[list[Doc]]:
    body = {"queries": queries, "topk": k, "return_scores": True}
    return results_from_json(self._request("POST", "/retrieve", body), len(queries))

  def _request(self, method: str, path: str, body: dict | None) -> Any:
    url = self.url + path
    data = None if body is None else json.dumps(body).encode("utf-8")
    headers = {"Content-Type": "application/json"} if data is not None else {}
    last: BaseException | None = None
    for attempt in range(self.max_retries + 1):
      if attempt:
        time.sleep(min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s))
      request = urllib.request.Request(url, data=data, headers=headers, method=method)
      try:
        with self._opener.open(request, timeout=self.timeout_s) as response:
          raw = response.read()
      except urllib.error.HTTPError as e:
        message = _error_message(e)
        if e.code >= 500 or e.code == 429:
          last = RetrieverError(f"HTTP {e.code}: {message}")
          continue
        raise RetrieverError(f"{method} {url} failed with HTTP {e.code}: {message}") from None
      except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
        last = e  # Refused or reset connections, timeouts, servers that hang up mid-answer.
        continue
      try:
        return json.loads(raw)
      except ValueError:
        raise RetrieverError(f"{method} {url} returned non-JSON: {raw[:200]!r}") from None
    raise RetrieverUnavailableError(url, self.max_retries + 1, last)


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
    data = json.dumps(payload).encode("utf-8")
    self.send_response(status)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(data)

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
    if length > MAX_BODY_BYTES:
      self.close_connection = True  # The unread body would corrupt the next request.
      self._send(413, {"error": f"body of {length} bytes exceeds {MAX_BODY_BYTES}"})
      return
    raw = self.rfile.read(length)
    try:
      queries, topk, return_scores = _parse_retrieve(json.loads(raw), self.server.max_topk)
    except (_BadRequest, ValueError) as e:
      message = str(e) if isinstance(e, _BadRequest) else f"invalid JSON: {e}"
      self._send(400, {"error": message})
      return
    try:
      results = self.server.search(queries, topk)
    except Exception as e:  # Report the retriever's failure to the client instead of hanging up.
      logging.exception("retrieval failed")
      self._send(500, {"error": f"retriever failed: {type(e).__name__}: {e}"})
      return
    if return_scores:
      payload = [[{"document": doc_to_json(d), "score": float(d.score)} for d in docs]
                 for docs in results]
    else:
      payload = [[doc_to_json(d) for d in docs] for docs in results]
    self._send(200, {"result": payload})


class RetrievalServer(http.server.ThreadingHTTPServer):
  """A threaded HTTP server answering /retrieve from a local `Retriever`.

  Attributes:
    url: "http://host:port", with the port actually bound (useful with port 0).
    requests, queries: how many /retrieve requests and queries were answered (tests count
      batches with these).
  """

  daemon_threads = True
  allow_reuse_address = True

  def __init__(self, retriever: Retriever, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
               max_topk: int = 1000):
    self.retriever, self.max_topk = retriever, max_topk
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
          start: bool = True, max_topk: int = 1000) -> RetrievalServer:
  """Binds a `RetrievalServer` for `retriever` (port 0 picks a free port).

  With `start` (the default) it already serves from a daemon thread; otherwise call
  `server.serve_forever()` yourself. Stop it with `server.close()` or a `with` block.
  """
  server = RetrievalServer(retriever, host, port, max_topk=max_topk)
  return server.start() if start else server


__all__ = ["DEFAULT_PORT", "HTTPRetriever", "RetrievalServer", "RetrieverError",
           "RetrieverUnavailableError", "doc_from_json", "doc_to_json", "results_from_json",
           "serve"]
