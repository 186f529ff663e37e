"""The server side of Search-R1's retrieval HTTP API: `RetrievalServer` and `serve`.

It answers `POST /retrieve` and `GET /health` (the format: `http_retriever`) from a local
`Retriever`, and treats every client as hostile. A request with more than `max_queries` queries,
a body over `max_body_bytes` or an answer that would exceed `max_response_bytes` gets a 413 with a
message; malformed or too deeply nested JSON, a query over `max_query_chars` characters (searches
take turns under one lock, so one huge query would stall every client) get a 400 with a message.
At most `max_workers` connections are served at once (more get a 503 at once, which clients retry
after a backoff); every connection's reads and writes have `timeout_s` per request in all, so an
idle keep-alive connection or a client dripping bytes frees its worker after `timeout_s`.

Standard library only: it runs in a small side process (`launch/retrieval_server.py`).
"""

from __future__ import annotations

import http.server
import logging
import sys
import threading
import time
from typing import Any

from trace_jax.envs.retrieval.wire import (DEFAULT_PORT, MAX_BODY_BYTES, MAX_QUERIES,
                                           MAX_RESPONSE_BYTES, AnswerTooLarge, BoundedSocket,
                                           encode_results, json_bytes, loads_bounded)
from trace_jax.envs.types import Doc, Retriever

# Longest query searched (characters): model-written queries are a sentence or two.
MAX_QUERY_CHARS = 16384
# Connections served at once, and seconds a connection may take to send one request (or to read
# one answer) in all, idle keep-alive time included.
MAX_WORKERS = 64
TIMEOUT_S = 30.0
# An oversized body up to this multiple of the limit is read and dropped (for at most
# _DRAIN_SECONDS) before the 413 goes out; a larger one gets the 413 and a closed connection.
_DRAIN_FACTOR = 16
_DRAIN_SECONDS = 10.0


class _BadRequest(ValueError):
  pass


def _parse_retrieve(body: Any, max_topk: int, max_query_chars: int) -> tuple[list[str], int, bool]:
  if not isinstance(body, dict):
    raise _BadRequest("request body must be a JSON object")
  queries = body.get("queries")
  if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
    raise _BadRequest("'queries' must be a list of strings")
  longest = max(map(len, queries), default=0)
  if longest > max_query_chars:
    raise _BadRequest(f"a query of {longest} characters exceeds this server's limit of "
                      f"{max_query_chars}")
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

  def setup(self) -> None:
    # Every read and write of the connection goes through a deadline, re-armed per request.
    self.timeout = self.server.timeout_s
    self._bounded = self.request = BoundedSocket(self.request)
    super().setup()

  def handle_one_request(self) -> None:
    self._bounded.set_deadline(time.monotonic() + self.server.timeout_s)
    super().handle_one_request()

  def log_message(self, format, *args):  # noqa: A002 - the base class's signature.
    logging.debug("retrieval server: " + format, *args)

  def _send(self, status: int, payload: Any) -> None:
    data = payload if isinstance(payload, bytes) else json_bytes(payload)
    self._bounded.set_deadline(time.monotonic() + self.server.timeout_s)
    self.send_response(status)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(data)

  def _drain(self, n: int) -> None:
    deadline = time.monotonic() + _DRAIN_SECONDS
    self._bounded.set_deadline(deadline)
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
      self._send(404, {"error": f"no route GET {self.path[:200]}; try /health or POST /retrieve"})

  def do_POST(self):  # noqa: N802
    if self.path.rstrip("/") != "/retrieve":
      self._send(404, {"error": f"no route POST {self.path[:200]}; use /retrieve"})
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
      queries, topk, return_scores = _parse_retrieve(
          loads_bounded(raw), self.server.max_topk, self.server.max_query_chars)
    except (_BadRequest, ValueError) as e:
      message = str(e) if isinstance(e, _BadRequest) else f"invalid JSON: {str(e)[:200]}"
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
      self._send(500, {"error": f"retriever failed: {type(e).__name__}: {str(e)[:500]}"})
      return
    try:
      data = encode_results(results, topk, return_scores, self.server.max_response_bytes)
    except AnswerTooLarge as e:
      self._send(413, {"error": str(e)})
      return
    self._send(200, data)


_BUSY = json_bytes({"error": "the retrieval server is busy (all workers serving); retry shortly"})


class RetrievalServer(http.server.HTTPServer):
  """An HTTP server answering /retrieve from a local `Retriever`, each connection in a thread of
  its own, at most `max_workers` at once (see the module docstring for every bound).

  Attributes:
    url: "http://host:port", with the port actually bound (useful with port 0).
    requests, queries: how many /retrieve requests and queries were answered (tests count
      batches with these).
    refused: connections turned away with a 503 because every worker was busy.
  """

  allow_reuse_address = True
  request_queue_size = 128  # connections the kernel holds while the accept loop catches up

  def __init__(self, retriever: Retriever, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
               max_topk: int = 1000, max_queries: int = MAX_QUERIES,
               max_response_bytes: int = MAX_RESPONSE_BYTES, max_body_bytes: int = MAX_BODY_BYTES,
               max_query_chars: int = MAX_QUERY_CHARS, max_workers: int = MAX_WORKERS,
               timeout_s: float = TIMEOUT_S):
    if max_topk < 1 or max_queries < 1 or min(max_response_bytes, max_body_bytes) < 1024:
      raise ValueError("max_topk and max_queries must be >= 1, max_response_bytes and "
                       "max_body_bytes >= 1024")
    if max_query_chars < 1 or max_workers < 1 or not timeout_s > 0:
      raise ValueError("max_query_chars and max_workers must be >= 1, timeout_s > 0")
    self.retriever, self.max_topk = retriever, max_topk
    self.max_queries, self.max_response_bytes = max_queries, max_response_bytes
    self.max_body_bytes, self.max_query_chars = max_body_bytes, max_query_chars
    self.max_workers, self.timeout_s = max_workers, timeout_s
    self.requests = self.queries = self.refused = 0
    # Retrievers promise no thread safety; HTTP parsing stays concurrent, searches take turns.
    self._search_lock = threading.Lock()
    self._count_lock = threading.Lock()
    self._workers = threading.BoundedSemaphore(max_workers)
    self._thread: threading.Thread | None = None
    super().__init__((host, port), _Handler)

  @property
  def port(self) -> int:
    return self.server_address[1]

  @property
  def url(self) -> str:
    return f"http://{self.server_address[0]}:{self.port}"

  def process_request(self, request, client_address) -> None:
    """Serves the connection in a daemon thread, or answers 503 when every worker is busy."""
    if not self._workers.acquire(blocking=False):
      with self._count_lock:
        self.refused += 1
      self._refuse(request)
      return
    try:
      threading.Thread(target=self._serve_connection, args=(request, client_address),
                       name="retrieval-worker", daemon=True).start()
    except BaseException:
      self._workers.release()
      self.shutdown_request(request)
      raise

  def _serve_connection(self, request, client_address) -> None:
    try:
      self.finish_request(request, client_address)
    except Exception:
      self.handle_error(request, client_address)
    finally:
      self.shutdown_request(request)
      self._workers.release()

  def _refuse(self, request) -> None:
    try:
      # Read what request bytes already arrived (without waiting): closing a socket with unread
      # data resets the connection, and the client might lose the 503 to the reset.
      request.setblocking(False)
      try:
        request.recv(1 << 16)
      except OSError:
        pass
      request.settimeout(1.0)
      request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                      b"Retry-After: 1\r\nConnection: close\r\nContent-Length: "
                      + str(len(_BUSY)).encode() + b"\r\n\r\n" + _BUSY)
    except OSError:
      pass
    finally:
      self.shutdown_request(request)

  def handle_error(self, request, client_address) -> None:
    """Logs instead of printing; a client that gave up, hung up or ran out of time is routine."""
    error = sys.exc_info()[1]
    if isinstance(error, (ConnectionError, TimeoutError)):
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
          max_response_bytes: int = MAX_RESPONSE_BYTES, max_body_bytes: int = MAX_BODY_BYTES,
          max_query_chars: int = MAX_QUERY_CHARS, max_workers: int = MAX_WORKERS,
          timeout_s: float = TIMEOUT_S) -> RetrievalServer:
  """Binds a `RetrievalServer` for `retriever` (port 0 picks a free port).

  With `start` (the default) it already serves from a daemon thread; otherwise call
  `server.serve_forever()` yourself. Stop it with `server.close()` or a `with` block.
  """
  server = RetrievalServer(retriever, host, port, max_topk=max_topk, max_queries=max_queries,
                           max_response_bytes=max_response_bytes, max_body_bytes=max_body_bytes,
                           max_query_chars=max_query_chars, max_workers=max_workers,
                           timeout_s=timeout_s)
  return server.start() if start else server


__all__ = ["MAX_QUERY_CHARS", "MAX_WORKERS", "RetrievalServer", "TIMEOUT_S", "serve"]
