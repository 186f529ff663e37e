"""HTTPRetriever against a real local retrieval server (127.0.0.1 only)."""

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from trace_jax.envs.retrieval.http_client import HTTPRetriever
from trace_jax.envs.retrieval.http_client import RetrieverError
from trace_jax.envs.retrieval.http_client import RetrieverUnavailableError
from trace_jax.envs.retrieval.http_client import doc_from_json
from trace_jax.envs.retrieval.http_client import results_from_json
from trace_jax.envs.retrieval.http_client import serve
from trace_jax.envs.types import Doc

DOCS = [
    Doc("0", "Ada Lovelace", "Ada Lovelace was born in London."),
    Doc("1", "London", "London is located in England.\nIt is large."),  # Multi-line text.
    Doc("2", "", "A passage without a title about Paris."),
    Doc("3", "Zork Inc", "Zork Inc was founded by Ada Lovelace in Paris ✓."),
    Doc("4", "Paris", "Paris is located in France."),
]


class WordOverlapRetriever:
  """A tiny deterministic retriever: score = shared lowercase words (ties by doc order)."""

  def __init__(self, docs):
    self.docs = docs
    self.calls = 0

  def search(self, queries, k):
    self.calls += 1
    out = []
    for q in queries:
      words = set(q.lower().split())
      scored = [(len(words & set(d.contents.lower().replace(".", "").split())) + 0.25 / (i + 1), i)
                for i, d in enumerate(self.docs)]
      scored.sort(key=lambda t: -t[0])
      out.append([Doc(self.docs[i].id, self.docs[i].title, self.docs[i].text, s)
                  for s, i in scored[:k]])
    return out


@pytest.fixture
def server():
  with serve(WordOverlapRetriever(DOCS), "127.0.0.1", 0) as srv:
    yield srv


def _post(url, body: bytes, path="/retrieve"):
  req = urllib.request.Request(url + path, data=body, method="POST",
                               headers={"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(req, timeout=5) as r:
      return r.status, json.loads(r.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]  # Closed on exit: nothing listens there.


def test_round_trip_equals_direct_search(server):
  queries = ["who founded zork inc", "where is london located", "paris passage", "nothing"]
  client = HTTPRetriever(server.url, timeout_s=5)
  got = client.search(queries, k=3)
  assert got == server.retriever.search(queries, 3)
  assert [d.id for d in got[0]] == ["3", "0", "1"]
  assert got[1][0].text == "London is located in England.\nIt is large."
  assert got[2][0] == Doc("2", "", "A passage without a title about Paris.", got[2][0].score)
  assert client.search([], k=3) == []
  assert client.health()["status"] == "ok"


def test_batching_splits_requests(server):
  queries = [f"query {i} paris" for i in range(10)]
  direct = server.retriever.search(queries, 2)
  assert HTTPRetriever(server.url, batch_size=3).search(queries, 2) == direct
  assert server.counts() == {"requests": 4, "queries": 10}  # 3 + 3 + 3 + 1.
  assert HTTPRetriever(server.url, batch_size=4, concurrency=3).search(queries, 2) == direct
  assert server.counts() == {"requests": 7, "queries": 20}


def test_search_r1_style_url_and_bare_documents(server):
  client = HTTPRetriever(server.url + "/retrieve/")
  assert client.url == server.url
  status, body = _post(server.url, json.dumps(
      {"queries": ["england large"], "topk": 2, "return_scores": False}).encode())
  assert status == 200
  assert body["result"][0][0] == {"id": "1", "contents": "London\nLondon is located in England."
                                  "\nIt is large.", "title": "London",
                                  "text": "London is located in England.\nIt is large."}
  [[first, _]] = results_from_json(body, 1)
  assert first == Doc("1", "London", "London is located in England.\nIt is large.", 0.0)


def test_parses_other_servers_documents():
  # Search-R1's server sends only id and contents; the title is the first line.
  assert doc_from_json({"id": 7, "contents": '"Title"\nbody\nmore'}, 1.5) == Doc(
      "7", "Title", "body\nmore", 1.5)
  assert doc_from_json({"id": "8", "contents": "no title"}) == Doc("8", "", "no title", 0.0)
  payload = {"result": [[{"document": {"id": "1", "contents": "T\nx"}, "score": 2.0}], []]}
  assert results_from_json(payload, 2) == [[Doc("1", "T", "x", 2.0)], []]
  with pytest.raises(RetrieverError, match="expected"):
    results_from_json({"result": [[]]}, 2)
  with pytest.raises(RetrieverError, match="contents"):
    doc_from_json({"id": "1"})


def test_bad_requests_get_json_errors(server):
  cases = [
      (b"{not json", "invalid JSON"),
      (b'["a"]', "JSON object"),
      (b'{"topk": 3}', "'queries'"),
      (b'{"queries": ["a", 3]}', "'queries'"),
      (b'{"queries": ["a"], "topk": 0}', "'topk'"),
      (b'{"queries": ["a"], "topk": true}', "'topk'"),
      (b'{"queries": ["a"], "return_scores": "yes"}', "'return_scores'"),
  ]
  for body, message in cases:
    status, payload = _post(server.url, body)
    assert status == 400 and message in payload["error"], (body, payload)
  assert _post(server.url, b"{}", path="/search")[0] == 404
  # The server still works after bad requests; none of them reached the retriever.
  assert server.retriever.calls == 0
  assert len(HTTPRetriever(server.url).search(["paris"], 1)[0]) == 1


def test_client_error_is_not_retried(server):
  client = HTTPRetriever(server.url + "/nope", max_retries=3, backoff_s=0.5)
  start = time.monotonic()
  with pytest.raises(RetrieverError, match="HTTP 404") as info:
    client.search(["q"], 1)
  assert not isinstance(info.value, RetrieverUnavailableError)
  assert time.monotonic() - start < 0.5  # No backoff sleeps.


def test_unreachable_server_raises_after_retries():
  url = f"http://127.0.0.1:{_free_port()}"
  client = HTTPRetriever(url, max_retries=2, backoff_s=0.02, timeout_s=0.5)
  start = time.monotonic()
  with pytest.raises(RetrieverUnavailableError) as info:
    client.search(["q"], 3)
  err = info.value
  assert err.attempts == 3 and err.url == url + "/retrieve"
  assert url in str(err) and "3 attempt" in str(err)
  assert time.monotonic() - start >= 0.02 + 0.04  # Exponential backoff between attempts.


def test_timeouts_are_retried_then_reported():
  class Slow:
    def search(self, queries, k):
      time.sleep(0.6)
      return [[] for _ in queries]

  with serve(Slow(), "127.0.0.1", 0) as srv:
    client = HTTPRetriever(srv.url, timeout_s=0.15, max_retries=1, backoff_s=0.01)
    with pytest.raises(RetrieverUnavailableError, match="timed out"):
      client.search(["q"], 1)
    assert srv.counts()["requests"] == 2


def test_server_errors_are_retried():
  class Flaky(WordOverlapRetriever):
    def search(self, queries, k):
      if self.calls < 2:
        self.calls += 1
        raise RuntimeError("index not warm yet")
      return super().search(queries, k)

  with serve(Flaky(DOCS), "127.0.0.1", 0) as srv:
    status, payload = _post(srv.url, b'{"queries": ["paris"]}')
    assert status == 500 and "index not warm yet" in payload["error"]
    client = HTTPRetriever(srv.url, max_retries=2, backoff_s=0.01)
    assert client.search(["paris france"], 1)[0][0].id == "4"
    assert srv.counts()["requests"] == 3


def test_concurrent_clients(server):
  queries = [f"where is {w}" for w in ("paris", "london", "zork", "ada")]
  expected = server.retriever.search(queries, 2)
  results, errors = [], []

  def worker():
    try:
      results.append(HTTPRetriever(server.url, batch_size=1).search(queries, 2))
    except Exception as e:  # Surfaced by the assert below.
      errors.append(e)

  threads = [threading.Thread(target=worker) for _ in range(6)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors and results == [expected] * 6


def test_argument_checks(server):
  client = HTTPRetriever(server.url)
  with pytest.raises(TypeError):
    client.search("one string", 1)
  with pytest.raises(ValueError):
    client.search(["q"], 0)
  with pytest.raises(ValueError):
    HTTPRetriever(server.url, batch_size=0)


# ------------------------------------------------------------------------- BM25 and the launcher

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = [
    {"id": "d0", "contents": '"Ada Lovelace"\nAda Lovelace was born in London in 1815.'},
    {"id": "d1", "contents": '"London"\nLondon is the capital of England.'},
    {"id": "d2", "contents": '"Zork Inc"\nZork Inc was founded by Ada Lovelace.'},
    {"id": "d3", "contents": '"Paris"\nParis is located in France.'},
    {"id": "d4", "contents": "an untitled passage about the founder of Zork"},
]
BM25_QUERIES = ["who founded Zork Inc", "where was Ada Lovelace born", "capital of England",
                "Paris France", "the"]


def _write_corpus(path):
  path.write_text("".join(json.dumps(r) + "\n" for r in CORPUS))
  return str(path)


def test_bm25_round_trip_in_process(tmp_path):
  from trace_jax.envs.retrieval.bm25 import BM25Retriever

  bm25 = BM25Retriever.from_jsonl(_write_corpus(tmp_path / "corpus.jsonl"))
  with serve(bm25, "127.0.0.1", 0) as srv:
    got = HTTPRetriever(srv.url, batch_size=2).search(BM25_QUERIES, 3)
  expected = bm25.search(BM25_QUERIES, 3)
  assert got == expected and got[0][0].id == "d2" and got[-1] == []
  # A server that only sends Search-R1's id + contents yields the same Docs.
  bare = [[doc_from_json({"id": d.id, "contents": d.contents}, d.score) for d in docs]
          for docs in expected]
  assert bare == expected


def _launch(*args):
  """Starts launch/retrieval_server.py on a free port; returns (process, url)."""
  proc = subprocess.Popen(
      [sys.executable, os.path.join(REPO, "launch", "retrieval_server.py"), *args, "--port", "0"],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
  line = proc.stdout.readline()
  if not line:
    proc.kill()
    raise AssertionError(f"server did not start: {proc.communicate()[1]}")
  match = re.search(r"on (http://127\.0\.0\.1:\d+)$", line.strip())
  assert match, line
  return proc, match.group(1)


def _stop(proc):
  proc.terminate()
  _, err = proc.communicate(timeout=20)
  assert proc.returncode == 0, err


@pytest.mark.parametrize("mode", ["corpus", "world"])
def test_launcher_serves_corpus_and_world_dir(tmp_path, mode):
  from trace_jax.envs.retrieval.bm25 import BM25Retriever

  corpus = _write_corpus(tmp_path / "corpus.jsonl")
  bm25 = BM25Retriever.from_jsonl(corpus)
  if mode == "corpus":
    args = ("--corpus", corpus, "--save_index", str(tmp_path / "saved"))
  else:
    world = tmp_path / "world"
    bm25.save(str(world / "index"))  # A world directory holding a saved index.
    args = ("--world", str(world))
  proc, url = _launch(*args)
  try:
    client = HTTPRetriever(url, timeout_s=10)
    assert client.health()["status"] == "ok"
    assert client.search(BM25_QUERIES, 2) == bm25.search(BM25_QUERIES, 2)
  finally:
    _stop(proc)
  if mode == "corpus":  # --save_index wrote a loadable index.
    assert BM25Retriever.load(str(tmp_path / "saved")).search(BM25_QUERIES, 2) == bm25.search(
        BM25_QUERIES, 2)


def test_launcher_rejects_empty_world_dir(tmp_path):
  out = subprocess.run(
      [sys.executable, os.path.join(REPO, "launch", "retrieval_server.py"), "--world",
       str(tmp_path), "--port", "0"], capture_output=True, text=True, timeout=60)
  assert out.returncode != 0 and "no saved BM25 index" in out.stderr


def test_launcher_serves_saved_synthetic_world(tmp_path):
  from trace_jax.envs.worlds.synthetic_world import SyntheticWorldConfig
  from trace_jax.envs.worlds.synthetic_world import generate_world

  world = generate_world(SyntheticWorldConfig(seed=2, n_entities=120, n_train=8, n_test=4))
  world.save(str(tmp_path / "world"))
  queries = [ex.question for ex in world.test] + [world.corpus[5].id]
  proc, url = _launch("--world", str(tmp_path / "world"))
  try:
    got = HTTPRetriever(url, timeout_s=10, batch_size=3).search(queries, 2)
  finally:
    _stop(proc)
  assert got == world.retriever().search(queries, 2)
  assert got[-1][0].id == world.corpus[5].id
