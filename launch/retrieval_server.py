"""Serves a local retriever over Search-R1's retrieval HTTP API (`POST /retrieve`, `GET /health`).

Rollout workers then use `HTTPRetriever("http://127.0.0.1:8000")`, and so does Search-R1's own
training code, which speaks the same API.

  # a saved BM25Retriever directory (BM25Retriever.save)
  python launch/retrieval_server.py --index /data/wiki18_bm25
  # a Search-R1 jsonl corpus ({"id", "contents"} a line), indexed on start; optionally saved
  python launch/retrieval_server.py --corpus /data/wiki-18.jsonl --save_index /data/wiki18_bm25
  # a synthetic world saved with World.save (or any directory with a saved index or corpus jsonl)
  python launch/retrieval_server.py --world runs/world_seed0 --port 0   # prints the chosen port

Requests are bounded: more than `--max_queries` queries, a body over `--max_body_bytes` or an
answer over `--max_response_bytes` get HTTP 413 with a message, and malformed or too deeply nested
JSON or a query over `--max_query_chars` characters get HTTP 400, instead of stalling the server
for every other client. At most `--max_workers` connections are served at once (more get HTTP
503, which clients retry), and each has `--timeout_s` seconds per request in all, so idle or
dripping connections free their worker.

The first stdout line is `serving <what> (<n> docs) on http://HOST:PORT`, so scripts that start
the server with `--port 0` can read the port from it.

From Python, `serve(retriever, host, port)` (re-exported here from
trace_jax.envs.retrieval.http_client) starts the same server in a background thread and returns it.
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import signal
import threading
import sys

from trace_jax.envs.retrieval.http_client import DEFAULT_PORT
from trace_jax.envs.retrieval.http_client import MAX_BODY_BYTES
from trace_jax.envs.retrieval.http_client import MAX_QUERIES
from trace_jax.envs.retrieval.http_client import MAX_QUERY_CHARS
from trace_jax.envs.retrieval.http_client import MAX_RESPONSE_BYTES
from trace_jax.envs.retrieval.http_client import MAX_WORKERS
from trace_jax.envs.retrieval.http_client import RetrievalServer
from trace_jax.envs.retrieval.http_client import TIMEOUT_S
from trace_jax.envs.retrieval.http_client import serve

# A directory written by synthetic_world.World.save.
_WORLD_FILE = "world.json"
# A saved BM25Retriever directory is recognised by this file (see envs/retrieval/bm25.py).
_INDEX_MARKER = "retriever.json"
# Corpus file names tried, in order, inside a --world directory.
_CORPUS_NAMES = ("corpus.jsonl", "docs.jsonl", "passages.jsonl")


def _find_index(directory: str) -> str | None:
  for candidate in (directory, os.path.join(directory, "index"),
                    os.path.join(directory, "bm25"), os.path.join(directory, "retriever")):
    if os.path.exists(os.path.join(candidate, _INDEX_MARKER)):
      return candidate
  return None


def _find_corpus(directory: str) -> str | None:
  for name in _CORPUS_NAMES:
    if os.path.exists(os.path.join(directory, name)):
      return os.path.join(directory, name)
  corpora = sorted(glob.glob(os.path.join(directory, "*corpus*.jsonl")))
  return corpora[0] if corpora else None


def build_retriever(index: str | None = None, corpus: str | None = None,
                    world: str | None = None, save_index: str | None = None):
  """Builds the BM25 retriever to serve from exactly one of index / corpus / world.

  Returns:
    (retriever, description) where description says what is served.
  """
  if sum(x is not None for x in (index, corpus, world)) != 1:
    raise ValueError("give exactly one of --index, --corpus, --world")
  if world is not None:
    if not os.path.isdir(world):
      raise FileNotFoundError(f"--world {world}: not a directory")
    if os.path.exists(os.path.join(world, _WORLD_FILE)):
      from trace_jax.envs.worlds.synthetic_world import World  # Lazy: only worlds need it.

      synthetic = World.load(world)
      return synthetic.retriever(), f"synthetic world {world}"
    index = _find_index(world)
    if index is None:
      corpus = _find_corpus(world)
      if corpus is None:
        raise FileNotFoundError(
            f"--world {world}: no {_WORLD_FILE}, no saved BM25 index ({_INDEX_MARKER}) and no "
            f"corpus jsonl ({', '.join(_CORPUS_NAMES)}) in it")
  # Imported here so that `serve` can be imported without pulling in bm25s.
  from trace_jax.envs.retrieval.bm25 import BM25Retriever

  if index is not None:
    retriever, what = BM25Retriever.load(index), f"BM25 index {index}"
  else:
    retriever, what = BM25Retriever.from_jsonl(corpus), f"BM25 over {corpus}"
    if save_index:
      retriever.save(save_index)
      logging.info("saved the BM25 index to %s", save_index)
  return retriever, what


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument("--index", help="a saved BM25Retriever directory")
  source.add_argument("--corpus", help="a Search-R1 jsonl corpus to index on start")
  source.add_argument("--world", help="a saved synthetic world, or a directory with a saved "
                      "index or a corpus jsonl")
  parser.add_argument("--save_index", help="with --corpus: save the built index here")
  parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
  parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 picks a free port")
  parser.add_argument("--max_topk", type=int, default=1000, help="largest topk a request may ask")
  parser.add_argument("--max_queries", type=int, default=MAX_QUERIES,
                      help="most queries in one request (more: HTTP 413 with a message)")
  parser.add_argument("--max_response_bytes", type=int, default=MAX_RESPONSE_BYTES,
                      help="largest answer built (larger: HTTP 413 with a message)")
  parser.add_argument("--max_body_bytes", type=int, default=MAX_BODY_BYTES,
                      help="largest request body read (larger: HTTP 413 with a message)")
  parser.add_argument("--max_query_chars", type=int, default=MAX_QUERY_CHARS,
                      help="longest query searched (longer: HTTP 400 with a message)")
  parser.add_argument("--max_workers", type=int, default=MAX_WORKERS,
                      help="connections served at once (more: HTTP 503, retried by clients)")
  parser.add_argument("--timeout_s", type=float, default=TIMEOUT_S,
                      help="seconds a connection has to send one request (or read one answer)")
  parser.add_argument("--log_level", default="INFO")
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
  retriever, what = build_retriever(args.index, args.corpus, args.world, args.save_index)
  server: RetrievalServer = serve(retriever, args.host, args.port, start=False,
                                  max_topk=args.max_topk, max_queries=args.max_queries,
                                  max_response_bytes=args.max_response_bytes,
                                  max_body_bytes=args.max_body_bytes,
                                  max_query_chars=args.max_query_chars,
                                  max_workers=args.max_workers, timeout_s=args.timeout_s)
  n_docs = len(retriever) if hasattr(retriever, "__len__") else "?"
  print(f"serving {what} ({n_docs} docs) on {server.url}", flush=True)

  # SIGTERM (from a job scheduler or a parent process) and Ctrl-C stop the serving loop from
  # another thread: an exception raised by the handler could land anywhere in the main thread
  # (between taking a worker slot and starting its thread, say) and leave the server half shut.
  def _stop(signum, frame):
    threading.Thread(target=server.shutdown, daemon=True).start()

  signal.signal(signal.SIGTERM, _stop)
  signal.signal(signal.SIGINT, _stop)
  try:
    server.serve_forever(poll_interval=0.2)
  finally:
    server.server_close()
    logging.info("retrieval server on %s stopped", server.url)
  return 0


__all__ = ["build_retriever", "main", "serve"]

if __name__ == "__main__":
  sys.exit(main())
