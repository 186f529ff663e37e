"""Inputs that cannot stall or crash a run: model-written answers and calculator calls, retrieval
servers and clients that misbehave on purpose, peers' host objects, and torn cache files.

Every test is bounded in time: work that could hang before its fix runs in a subprocess with a
timeout, a thread joined with a timeout, or against a socket with a timeout, so a regression fails
rather than hangs the suite.
"""

import dataclasses
import http.client
import json
import os
import pickle
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from trace_jax.envs.tasks.calculator import CalculatorError, calculate
from trace_jax.envs.retrieval.http_client import (HTTPRetriever, RetrieverError, doc_from_json,
                                           results_from_json, serve)
from trace_jax.envs.tasks.math_world import make_math_env
from trace_jax.envs.types import Doc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ----------------------------------------------------------------------------- math answers

TOWERS = ["9 * * 9 * * 9 * * 9", "9**9**9", "9^{9^{9}}", "(9^999)^999", "$99999!$",
          "$\\binom{99999999}{49999999}$", "$\\Gamma(99999999)$", "$(x+y+z)^{99}$",
          "\\left(9^{999}\\right)^{999}", "$\\operatorname{zeros}(99999,99999)$"]

_CHECK = textwrap.dedent("""
    import json, sys, threading, time
    from trace_jax.envs.tasks.math_world import answers_match, make_math_env
    answers = json.loads(sys.argv[1])
    def check(where):
      for a in answers:
        t0 = time.monotonic()
        ok = answers_match(a, ["30"])
        print(json.dumps([where, a, ok, time.monotonic() - t0]), flush=True)
      env = make_math_env(max_turns=3)
      s = env.reset({"answers": ["30"], "id": "p"})
      r = env.step_batch([s], ["<answer> 9 * * 9 * * 9 * * 9 </answer>"])[0]
      print(json.dumps([where, "env", r.done, r.reward]), flush=True)
    check("main")
    worker = threading.Thread(target=check, args=("thread",))
    worker.start()
    worker.join()
""")


def test_power_towers_and_factorials_are_wrong_answers_not_stalls():
  # Before the fix sympy evaluated 9**(9**(9**9)) with math-verify's timeouts off, forever (and
  # in a worker thread no signal can stop it): run in a subprocess that is killed at the timeout.
  try:
    out = subprocess.run([sys.executable, "-c", _CHECK, json.dumps(TOWERS)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"the answer check stalled; it printed: {e.stdout}")
  assert out.returncode == 0, out.stderr[-2000:]
  rows = [json.loads(line) for line in out.stdout.splitlines()]
  checks = [r for r in rows if r[1] != "env"]
  assert len(checks) == 2 * len(TOWERS)
  assert not any(ok for _, _, ok, _ in checks)
  assert max(dt for _, _, _, dt in checks) < 5.0, checks
  assert [r for r in rows if r[1] == "env"] == [["main", "env", True, 0.0],
                                               ["thread", "env", True, 0.0]]


def test_cost_screen_keeps_ordinary_answers():
  from trace_jax.envs.tasks.math_world import too_costly

  for text in TOWERS + ["2^{99999}", "9^9^9", "$10^{10^{10}}$", "9 ** 9999", "$9^{9}^{9}$"]:
    assert too_costly(text), text
  for text in ["42", "1/2", "\\frac{1}{2}", "2^{10}", "$x^2+1$", "$e^{i\\pi}$", "$10^{-3}$",
               "$90^\\circ$", "$(x+1)^2$", "$2^{\\frac{1}{3}}$", "\\boxed{30}", "3 ** 2"]:
    assert not too_costly(text), text


# ----------------------------------------------------------------------------- calculator


def test_non_finite_numbers_are_a_calculator_error_and_an_error_observation():
  for text in ("1e999", "-1e999", "1e999 - 1e999", "2 * 1e400"):
    with pytest.raises(CalculatorError, match="too large"):
      calculate(text)
  env = make_math_env(max_turns=3)
  s = env.reset({"answers": ["30"], "id": "p"})
  r = env.step_batch([s], ["<calculate> 1e999 </calculate>"])[0]
  assert r.observation_text == "<result> error : number too large </result>" and not r.done


# ----------------------------------------------------------------------------- raw peers


class _RawPeer:
  """A TCP server on 127.0.0.1 running `handle(conn, peer)` for each connection in a thread;
  counts connections."""

  def __init__(self, handle):
    self.handle, self.connections, self._stop = handle, 0, threading.Event()
    self.sock = socket.socket()
    self.sock.bind(("127.0.0.1", 0))
    self.sock.listen(64)
    self.sock.settimeout(0.05)
    self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

  def _loop(self):
    while not self._stop.is_set():
      try:
        conn, _ = self.sock.accept()
      except OSError:
        continue
      self.connections += 1
      threading.Thread(target=self._run, args=(conn,), daemon=True).start()

  def _run(self, conn):
    try:
      conn.settimeout(10)
      self.handle(conn, self)
    except OSError:
      pass
    finally:
      conn.close()

  def __enter__(self):
    threading.Thread(target=self._loop, daemon=True).start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self.sock.close()


def _read_request(conn):
  data = b""
  while b"\r\n\r\n" not in data:
    chunk = conn.recv(65536)
    if not chunk:
      return data
    data += chunk
  head, _, body = data.partition(b"\r\n\r\n")
  for line in head.split(b"\r\n"):
    if line.lower().startswith(b"content-length:"):
      n = int(line.split(b":")[1])
      while len(body) < n:
        body += conn.recv(65536)
  return head


def _search_in_thread(client, timeout_s):
  """Runs `client.search(["q"], 1)` in a thread; (exception or result, seconds) or pytest.fail
  when it is still running after `timeout_s`."""
  out = {}

  def run():
    t0 = time.monotonic()
    try:
      out["value"] = client.search(["q"], 1)
    except BaseException as e:  # noqa: BLE001 - reported to the test
      out["value"] = e
    out["seconds"] = time.monotonic() - t0

  worker = threading.Thread(target=run, daemon=True)
  worker.start()
  worker.join(timeout_s)
  if worker.is_alive():
    pytest.fail(f"the search was still running after {timeout_s} s")
  return out["value"], out["seconds"]


# ----------------------------------------------------------------------------- HTTP client


def test_client_reads_only_the_start_of_a_huge_error_body():
  size, sent = 40 * 1024 * 1024, []

  def handle(conn, peer):
    _read_request(conn)
    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(size).encode() + b"\r\n\r\n")
    chunk, n = b"x" * (1 << 16), 0
    try:
      while n < size:
        n += conn.send(chunk[: size - n])
    except OSError:
      pass
    sent.append(n)

  with _RawPeer(handle) as peer:
    client = HTTPRetriever(peer.url, max_response_bytes=4096, max_retries=0, timeout_s=5.0)
    error, seconds = _search_in_thread(client, 30)
    deadline = time.monotonic() + 10
    while not sent and time.monotonic() < deadline:
      time.sleep(0.05)
  assert isinstance(error, RetrieverError) and "HTTP 400" in str(error)
  # Before the fix the whole 40 MB was read; now at most a few socket buffers' worth is sent.
  assert sent and sent[0] < size // 2, sent


def test_client_reads_headers_only_up_to_its_byte_limit():
  def handle(conn, peer):
    _read_request(conn)
    body = json.dumps({"result": [[{"document": {"contents": "T\\nx"}, "score": 1.0}]]})
    conn.sendall(b"HTTP/1.1 200 OK\r\n")
    for i in range(90):  # 90 headers of 60 kB: what http.client alone would read whole
      conn.sendall(b"X-Pad-%d: " % i + b"p" * 60_000 + b"\r\n")
    conn.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body.encode())

  with _RawPeer(handle) as peer:
    client = HTTPRetriever(peer.url, max_response_bytes=4096, max_retries=0, timeout_s=5.0)
    error, _ = _search_in_thread(client, 30)
  # Before: the 5.4 MB of headers were read whole and the answer taken.
  assert isinstance(error, RetrieverError) and "max_response_bytes" in str(error), error


@pytest.mark.parametrize("where", ["headers", "body"])
def test_a_dripping_server_cannot_hold_the_client_past_its_deadline(where):
  def handle(conn, peer):
    _read_request(conn)
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n"
    if where == "body":
      conn.sendall(head + b"\r\n")
    else:
      conn.sendall(head)
    for _ in range(400):  # one byte every 0.05 s: each read waits far less than timeout_s
      conn.sendall(b"X" if where == "headers" else b" ")
      time.sleep(0.05)

  with _RawPeer(handle) as peer:
    client = HTTPRetriever(peer.url, timeout_s=0.6, max_retries=0)
    error, seconds = _search_in_thread(client, 15)
  assert isinstance(error, RetrieverError), error
  assert seconds < client.worst_case_s() + 0.5, seconds


def test_client_follows_no_redirect_to_another_host():
  def other(conn, peer):
    _read_request(conn)
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 14\r\n\r\n{\"result\": []}")

  with _RawPeer(other) as elsewhere:
    def redirect(conn, peer):
      _read_request(conn)
      conn.sendall(b"HTTP/1.1 302 Found\r\nLocation: " + elsewhere.url.encode() +
                   b"/retrieve\r\nContent-Length: 0\r\n\r\n")

    with _RawPeer(redirect) as peer:
      client = HTTPRetriever(peer.url, max_retries=0, timeout_s=5.0)
      error, _ = _search_in_thread(client, 30)
  assert isinstance(error, RetrieverError) and "redirect" in str(error), error
  assert elsewhere.connections == 0


@pytest.mark.parametrize("score", ["abc", None, {"x": 1}, [1], "nan", True])
def test_a_bad_score_is_a_retriever_error(score):
  hit = {"document": {"id": "1", "contents": "T\nx"}, "score": score}
  with pytest.raises(RetrieverError, match="score"):
    results_from_json({"result": [[hit]]}, 1)
  with pytest.raises(RetrieverError, match="score"):
    doc_from_json({"contents": "x"}, score)

  def handle(conn, peer):
    _read_request(conn)
    body = json.dumps({"result": [[hit]]}).encode()
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(body)).encode() +
                 b"\r\n\r\n" + body)

  with _RawPeer(handle) as peer:
    error, _ = _search_in_thread(HTTPRetriever(peer.url, max_retries=0, timeout_s=5.0), 30)
  assert isinstance(error, RetrieverError), error


# ----------------------------------------------------------------------------- retrieval server


class _Docs:
  def search(self, queries, k):
    return [[Doc("1", "T", "paris")] for _ in queries]


def _post(url, body: bytes, timeout=10):
  host, port = url.removeprefix("http://").split(":")
  conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
  try:
    conn.request("POST", "/retrieve", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read())
  finally:
    conn.close()


def test_server_answers_too_deep_json_with_a_400():
  with serve(_Docs(), "127.0.0.1", 0) as srv:
    status, answer = _post(srv.url, b"[" * 200_000)  # before: RecursionError, a dropped line
    assert status == 400 and "nested too deeply" in answer["error"]
    assert _post(srv.url, json.dumps({"queries": ["paris"], "topk": 1}).encode())[0] == 200


def test_server_refuses_an_overlong_query_with_a_400():
  with serve(_Docs(), "127.0.0.1", 0) as srv:  # (default limit: 16384 characters)
    status, answer = _post(srv.url, json.dumps({"queries": ["a" * 20_000], "topk": 1}).encode())
    assert status == 400 and "20000 characters" in answer["error"]
    assert srv.counts()["queries"] == 0  # never searched under the search lock


def _threads_settle(before, most, seconds=10):
  deadline = time.monotonic() + seconds
  while threading.active_count() - before > most and time.monotonic() < deadline:
    time.sleep(0.05)
  return threading.active_count() - before


def test_server_serves_at_most_max_workers_connections_at_once():
  before = threading.active_count()
  with serve(_Docs(), "127.0.0.1", 0) as srv:  # (default: 64 workers)
    idle = [socket.create_connection(srv.server_address, timeout=10) for _ in range(80)]
    time.sleep(0.5)
    assert threading.active_count() - before <= 64 + 1  # before: a thread per connection
    answer = b""
    while chunk := idle[-1].recv(4096):
      answer += chunk
    assert answer.startswith(b"HTTP/1.1 503")
    for conn in idle:
      conn.close()
    assert _threads_settle(before, 1) <= 1  # every worker freed


def test_server_drops_idle_and_dripping_connections_after_its_timeout():
  before = threading.active_count()
  with serve(_Docs(), "127.0.0.1", 0, timeout_s=1.0) as srv:
    idle = socket.create_connection(srv.server_address, timeout=10)
    drip = socket.create_connection(srv.server_address, timeout=0.1)
    drip.sendall(b"POST /retrieve HTTP/1.1\r\n")
    t0, closed = time.monotonic(), False
    while not closed and time.monotonic() - t0 < 5.0:  # one byte every 0.1 s
      try:
        drip.sendall(b"X")
        closed = drip.recv(1024) == b""
      except socket.timeout:
        continue
      except OSError:
        closed = True
    assert closed and time.monotonic() - t0 < 3.0  # the request's deadline (1 s) ended it
    assert idle.recv(1024) == b""  # closed by the server, not by this side's 10 s timeout
    assert _threads_settle(before, 1) <= 1
    assert _post(srv.url, json.dumps({"queries": ["q"], "topk": 1}).encode())[0] == 200
    idle.close()
    drip.close()


def test_busy_server_answers_503_which_the_client_retries():
  with serve(_Docs(), "127.0.0.1", 0, max_workers=1, timeout_s=1.0) as srv:
    hog = socket.create_connection(srv.server_address, timeout=10)
    time.sleep(0.2)
    with socket.create_connection(srv.server_address, timeout=10) as s:
      answer = b""
      while chunk := s.recv(4096):
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 503") and b"busy" in answer
    hog.close()
    client = HTTPRetriever(srv.url, max_retries=3, backoff_s=0.5, timeout_s=5.0)
    value, _ = _search_in_thread(client, 30)
    assert value == [[Doc("1", "T", "paris")]]


# ----------------------------------------------------------------------------- peers' objects


class _FakeStore:
  """The coordination service's key-value store, in memory, as `allgather_object` uses it."""

  def __init__(self):
    self.kv = {}

  def key_value_set_bytes(self, key, value):
    self.kv[key] = bytes(value)

  def key_value_set(self, key, value):
    self.kv[key] = value

  def blocking_key_value_get(self, key, timeout_ms):
    return self.kv[key]

  def blocking_key_value_get_bytes(self, key, timeout_ms):
    return self.kv[key]

  def key_value_delete(self, key):
    self.kv = {k: v for k, v in self.kv.items() if not k.startswith(key)}


class _Payload:
  def __init__(self, path):
    self.path = path

  def __reduce__(self):  # what a hostile peer's pickle does when loaded: run a call of its own
    return (open, (self.path, "w"))


def _gather_from_peer(monkeypatch, peer_blob, mine):
  from trace_jax.parallel import distributed

  store = _FakeStore()
  monkeypatch.setattr(distributed.jax, "process_count", lambda: 2)
  monkeypatch.setattr(distributed.jax, "process_index", lambda: 0)
  monkeypatch.setattr(distributed, "_client", lambda: store)
  seq = distributed._seq["gather"]
  store.kv[f"trace_jax/gather/{seq}/1/0"] = peer_blob
  store.kv[f"trace_jax/gather/{seq}/1/n"] = "1"
  return distributed.allgather_object(mine)


def test_a_peers_pickle_is_refused_and_never_run(monkeypatch, tmp_path):
  marker = tmp_path / "ran"
  with pytest.raises(ValueError):
    _gather_from_peer(monkeypatch, pickle.dumps(_Payload(str(marker))), {"a": 1})
  assert not marker.exists()


def test_host_objects_round_trip_exactly_and_others_are_refused_at_the_sender(monkeypatch):
  from trace_jax.parallel.distributed import decode_object, encode_object
  from trace_jax.sampling.tree import Node, Tree

  tree = Tree([1, 2, 3], uid=7, meta={"answers": ["paris"], "pair": (1, 2.5)})
  node = tree.add_node(0, gen_ids=[4, 5], logprobs=[-0.5, -0.25],
                       feature=np.arange(4, dtype=np.float32))
  node.done, node.reward = True, 1.0
  value = ([tree], {"rollouts_started": 3, 2: (None, b"\x00")}, -2 ** 70, 1.5,
           np.float32(0.25), np.arange(6, dtype=np.int32).reshape(2, 3))
  got = _gather_from_peer(monkeypatch, encode_object(value), value)
  for back in (got[1], decode_object(encode_object(value))):
    assert type(back[0][0]) is Tree and type(back[0][0].nodes[1]) is Node
    assert back[0][0].to_json() == tree.to_json()
    assert back[0][0].nodes[1].feature.dtype == np.float32
    assert back[1:4] == value[1:4] and type(back[4]) is np.float32 and back[4] == value[4]
    np.testing.assert_array_equal(back[5], value[5])
    assert back[5].dtype == np.int32
  for bad in (object(), {1, 2}, np.array(["text"]), dataclasses.make_dataclass("D", [])()):
    with pytest.raises(TypeError, match="cannot be sent"):
      encode_object(bad)


# ----------------------------------------------------------------------------- atomic files


def _small_world():
  from trace_jax.envs.worlds import synthetic as syn

  return syn.generate_world(syn.SyntheticWorldConfig(seed=3, n_entities=300, n_train=200,
                                                     n_test=60))


def test_a_world_save_that_fails_midway_leaves_the_old_file_whole(tmp_path):
  from trace_jax.envs.worlds.synthetic_world import World

  world = _small_world()
  world.save(str(tmp_path))
  broken = dataclasses.replace(world, traps={**world.traps, "x": object()})  # fails late
  with pytest.raises(TypeError):
    broken.save(str(tmp_path))
  assert os.listdir(tmp_path) == ["world.json"]  # no temporary file left behind
  again = World.load(str(tmp_path))  # before: a torn world.json, unreadable
  assert again.train == world.train and again.corpus == world.corpus


def test_a_torn_world_file_is_reported_as_corrupt(tmp_path):
  from trace_jax.envs.worlds.synthetic_world import World
  from trace_jax.fileio import CorruptFileError

  _small_world().save(str(tmp_path))
  path = tmp_path / "world.json"
  raw = path.read_bytes()
  path.write_bytes(raw[: len(raw) // 2])
  with pytest.raises(CorruptFileError, match="world.json"):
    World.load(str(tmp_path))
  path.write_text(json.dumps({"format_version": 1, "config": {}}))
  with pytest.raises(CorruptFileError, match="world.json"):
    World.load(str(tmp_path))


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path):
  from trace_jax.fileio import atomic_write_json, atomic_write_text, read_json

  path = str(tmp_path / "config.json")
  atomic_write_json(path, {"a": 1}, indent=1)
  with pytest.raises(TypeError):
    atomic_write_json(path, {"a": object()})
  assert read_json(path) == {"a": 1} and os.listdir(tmp_path) == ["config.json"]
  atomic_write_text(path, "done")
  assert open(path).read() == "done"


def test_a_concurrent_reader_never_sees_a_half_written_world(tmp_path):
  """One process rewrites the world cache while another reads it: every read is a whole world
  (written in place, the reader failed 5 of 5 times)."""
  world = _small_world()
  world.save(str(tmp_path))
  reader = ("import sys, time\n"
            "from trace_jax.envs.worlds.synthetic_world import World\n"
            "t = time.time(); n = 0\n"
            "while time.time() - t < 3:\n"
            "  World.load(sys.argv[1]); n += 1\n"
            "print(n)\n")
  p = subprocess.Popen([sys.executable, "-c", reader, str(tmp_path)], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 3
  while time.time() < deadline and p.poll() is None:
    world.save(str(tmp_path))
  out, err = p.communicate(timeout=60)
  assert p.returncode == 0, err[-2000:]
  assert int(out.strip()) > 0


def test_the_world_cache_rebuilds_a_torn_file(tmp_path):
  """`cached_world` reads a whole cached world, and rebuilds one a killed run left torn."""
  from trace_jax.assets import cached_world
  from trace_jax.envs.worlds.synthetic_world import World

  built = []

  def generate():
    built.append(1)
    return _small_world()

  wdir = str(tmp_path / "w")
  first = cached_world(wdir, "world.json", generate, World.load)
  again = cached_world(wdir, "world.json", generate, World.load)
  assert len(built) == 1 and again.train == first.train
  path = tmp_path / "w" / "world.json"
  path.write_bytes(path.read_bytes()[:1000])
  rebuilt = cached_world(wdir, "world.json", generate, World.load)
  assert len(built) == 2 and rebuilt.train == first.train
  assert World.load(wdir).train == first.train  # whole again on disk


def test_a_torn_tool_task_world_is_reported_as_corrupt(tmp_path):
  from trace_jax.envs.tasks.math_world import MathWorld, MathWorldConfig, generate_math_world
  from trace_jax.fileio import CorruptFileError

  generate_math_world(MathWorldConfig(seed=0, n_train=8, n_test=4)).save(str(tmp_path))
  path = tmp_path / MathWorld.FILE
  path.write_bytes(path.read_bytes()[:50])
  with pytest.raises(CorruptFileError, match=MathWorld.FILE):
    MathWorld.load(str(tmp_path))
