"""Tool faults are bounded and visible: hung, dead, flaky, oversized and non-compliant retrieval
servers (all on 127.0.0.1), the config's retriever settings, stats and observation caps."""

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from configs import mhqa, runs
from trace_jax.warm_start import warm_start_key
from trace_jax import assets as assets_lib
from trace_jax.envs import react
from trace_jax.envs.tasks.multihop import MultiHopEnv
from trace_jax.envs.retrieval.http_client import (
  HTTPRetriever,
  RetrieverError,
  RetrieverUnavailableError,
  serve,
)
from trace_jax.envs.types import Doc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


DOCS = [Doc(str(i), f"T{i}", f"passage {i} about paris") for i in range(60)]


class FixedRetriever:
  """Returns the first k documents for every query."""

  def __init__(self, docs=DOCS):
    self.docs = docs

  def search(self, queries, k):
    return [list(self.docs[:k]) for _ in queries]


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class _HungServer:
  """A socket that accepts connections (the kernel's backlog) and never answers."""

  def __enter__(self):
    self.sock = socket.socket()
    self.sock.bind(("127.0.0.1", 0))
    self.sock.listen(16)
    self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
    return self

  def __exit__(self, *exc):
    self.sock.close()


class _RawServer:
  """Answers every request with a fixed status and body (a non-compliant server), optionally
  sending the body one small piece at a time (`trickle_s` between pieces)."""

  def __init__(self, body: bytes, status: int = 200, trickle_s: float = 0.0):
    outer = self
    self.requests = 0

    class Handler(http.server.BaseHTTPRequestHandler):
      protocol_version = "HTTP/1.1"

      def log_message(self, *args):
        pass

      def _answer(self):
        outer.requests += 1
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not trickle_s:
          self.wfile.write(body)
          return
        for i in range(0, len(body), 8):
          try:
            self.wfile.write(body[i:i + 8])
            self.wfile.flush()
          except OSError:
            return
          time.sleep(trickle_s)

      do_GET = do_POST = _answer

    self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.httpd.daemon_threads = True
    self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

  def __enter__(self):
    threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                     daemon=True).start()
    return self

  def __exit__(self, *exc):
    self.httpd.shutdown()
    self.httpd.server_close()


def _hits_payload(n_queries, n_docs, text="x"):
  hit = {"document": {"id": "1", "contents": f"Title\n{text}"}, "score": 1.0}
  return json.dumps({"result": [[hit] * n_docs for _ in range(n_queries)]}).encode()


def _http_config(url, **retriever):
  c = mhqa.get_config("smoke")
  c.retriever.kind, c.retriever.url = "http", url
  for k, v in retriever.items():
    c.retriever[k] = v
  return c


# ----------------------------------------------------------------------------- time bounds


def test_hung_server_costs_at_most_timeout_times_attempts_plus_backoff():
  with _HungServer() as hung:
    client = HTTPRetriever(hung.url, timeout_s=0.3, max_retries=2, backoff_s=0.05,
                           max_backoff_s=0.05)
    assert client.worst_case_s() == pytest.approx(0.3 * 3 + 0.1)
    t0 = time.monotonic()
    with pytest.raises(RetrieverUnavailableError, match="timed out") as info:
      client.search(["q"], 3)
    elapsed = time.monotonic() - t0
  assert 0.3 * 3 <= elapsed <= client.worst_case_s() + 0.5, elapsed
  assert info.value.attempts == 3 and hung.url in str(info.value)
  s = client.stats()
  assert (s["requests"], s["retries"], s["timeouts"], s["errors"]) == (3, 2, 3, 1)
  assert 0.25 <= s["latency_mean_s"] <= s["latency_max_s"] <= 0.3 + 0.3


def test_config_fields_reach_the_http_retriever_and_bound_a_hung_search():
  with _HungServer() as hung:
    c = _http_config(hung.url, timeout_s=0.2, retries=1, backoff_s=0.05, max_backoff_s=1.0,
                     batch_size=7, concurrency=2, health_check=False)
    mhqa.validate(c)
    r = assets_lib.build_retriever(c)
    assert (r.timeout_s, r.max_retries, r.backoff_s, r.max_backoff_s, r.batch_size,
            r.concurrency) == (0.2, 1, 0.05, 1.0, 7, 2)
    env = MultiHopEnv(r, max_turns=3, topk=2)
    states = [env.reset("x") for _ in range(3)]
    t0 = time.monotonic()
    results = env.step_batch(states, ["<search> a </search>"] * 3)
    elapsed = time.monotonic() - t0
  # The failure became error observations (the rollouts continue), within the bound.
  assert elapsed <= r.worst_case_s() + 0.5, elapsed
  assert [x.observation_text for x in results] == [react.format_error_observation()] * 3
  stats = env.retriever_stats(reset=True)
  assert stats["retriever_errors"] == 1 and stats["retriever_calls"] == 1
  assert stats["retriever_retries"] == 1 and stats["retriever_timeouts"] == 2
  assert stats["retriever_latency_max_s"] >= 0.4


def test_trickling_server_is_cut_at_the_timeout():
  with _RawServer(_hits_payload(1, 1, "y" * 400), trickle_s=0.05) as srv:
    client = HTTPRetriever(srv.url, timeout_s=0.3, max_retries=0)
    t0 = time.monotonic()
    with pytest.raises(RetrieverUnavailableError):
      client.search(["q"], 1)
    assert time.monotonic() - t0 < 1.0  # the whole body would take ~3 s


# ----------------------------------------------------------------------------- 4xx and caps


def test_too_many_queries_is_a_413_surfaced_at_once_not_retried():
  with serve(FixedRetriever(), "127.0.0.1", 0, max_queries=5) as srv:
    client = HTTPRetriever(srv.url, batch_size=100, max_retries=3, backoff_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(RetrieverError, match="HTTP 413.*6 queries.*limit of 5") as info:
      client.search([f"q{i}" for i in range(6)], 2)
    assert time.monotonic() - t0 < 0.9  # no backoff sleep
    assert not isinstance(info.value, RetrieverUnavailableError)
    assert srv.counts()["requests"] == 0  # refused before searching
    assert client.stats()["retries"] == 0 and client.stats()["errors"] == 1
    # Within the limit all is well, and batching keeps a large search under it.
    assert len(HTTPRetriever(srv.url, batch_size=5).search(["q"] * 12, 2)) == 12


def test_client_splits_a_batch_whose_body_is_too_large_instead_of_sending_it():
  with serve(FixedRetriever(), "127.0.0.1", 0) as srv:
    client = HTTPRetriever(srv.url, batch_size=1000, max_request_bytes=2048)
    queries = [f"{i} " + "w" * 60 for i in range(100)]  # ~6.5 KB as one body
    assert client.search(queries, 1) == FixedRetriever().search(queries, 1)
    assert srv.counts() == {"requests": 4, "queries": 100}
    with pytest.raises(RetrieverError, match="max_request_bytes"):
      client.search(["z" * 5000], 1)  # one query alone is too large: no request at all
    assert srv.counts()["requests"] == 4


def test_oversized_body_gets_the_413_not_a_reset_taken_for_an_outage():
  with serve(FixedRetriever(), "127.0.0.1", 0, max_body_bytes=4 << 20) as srv:
    # A client that does not split (as another client might): 3M queries, ~48 MB.
    client = HTTPRetriever(srv.url, batch_size=10**7, max_request_bytes=1 << 30, max_retries=2,
                           backoff_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(RetrieverError, match="HTTP 413.*exceeds.*limit of 4194304") as info:
      client.search(["abcdefghijklm"] * 3_000_000, 1)
    assert not isinstance(info.value, RetrieverUnavailableError)
    assert time.monotonic() - t0 < 0.9 + 5  # not retried (the body itself takes a moment)
    assert srv.counts()["requests"] == 0
    assert HTTPRetriever(srv.url).search(["q"], 1) == FixedRetriever().search(["q"], 1)


def test_server_refuses_to_build_an_oversized_answer():
  huge = [Doc(str(i), "T", "t" * 2000) for i in range(10)]
  with serve(FixedRetriever(huge), "127.0.0.1", 0, max_response_bytes=50_000) as srv:
    client = HTTPRetriever(srv.url, batch_size=500, max_retries=2, backoff_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(RetrieverError, match="HTTP 413.*exceeds.*50000 bytes"):
      client.search(["q"] * 100, 10)  # ~2 MB if built
    assert time.monotonic() - t0 < 0.9
    assert len(client.search(["q"], 10)[0]) == 10  # ~40 KB: fine
    # Another client is served while big requests are refused.
    assert HTTPRetriever(srv.url).health()["status"] == "ok"


def test_client_refuses_an_oversized_answer():
  with _RawServer(_hits_payload(1, 1, "z" * 5000)) as srv:
    client = HTTPRetriever(srv.url, max_response_bytes=4096, max_retries=3, backoff_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(RetrieverError, match="max_response_bytes"):
      client.search(["q"], 1)
    assert time.monotonic() - t0 < 0.9 and srv.requests == 1


def test_client_keeps_at_most_k_documents_when_the_server_sends_fifty():
  with _RawServer(_hits_payload(2, 50)) as srv:
    got = HTTPRetriever(srv.url).search(["a", "b"], 3)
    assert [len(d) for d in got] == [3, 3]
    env = MultiHopEnv(FixedRetriever(DOCS), topk=3)  # an in-process retriever ignoring k: capped
    env.retriever.search = lambda queries, k: [list(DOCS[:50]) for _ in queries]
    [res] = env.step_batch([env.reset("x")], ["<search> q </search>"])
    assert res.info["n_docs"] == 3 and res.observation_text.count("Doc ") == 3
    assert env.retriever_stats()["obs_docs_dropped"] == 47


# ----------------------------------------------------------------------------- observation caps


def test_huge_documents_give_a_bounded_observation_with_the_closing_tag():
  with _RawServer(_hits_payload(1, 3, "w " * 500_000)) as srv:  # 3 MB of passages
    env = MultiHopEnv(HTTPRetriever(srv.url), topk=3, max_obs_bytes=4096)
    [res] = env.step_batch([env.reset("x")], ["<search> q </search>"])
  obs = res.observation_text
  assert len(obs.encode()) <= 4096 and obs.startswith(react.INFO_OPEN)
  assert obs.endswith(react.INFO_CLOSE) and obs.count("Doc ") == 3  # every passage keeps a share
  assert env.retriever_stats()["obs_truncated"] == 1


def test_byte_cap_is_fair_and_utf8_safe():
  docs = [Doc("0", "A", "short"), Doc("1", "B", "é" * 3000), Doc("2", "C", "x" * 3000)]
  text, cut = react.fit_observation(docs, max_bytes=1000)
  assert cut and len(text.encode()) <= 1000 and text.endswith(react.INFO_CLOSE)
  lines = text[len(react.INFO_OPEN):-len(react.INFO_CLOSE)].split("\n")
  assert lines[0] == "Doc 1(Title: A) short"  # the short passage is kept whole
  assert abs(len(lines[1].encode()) - len(lines[2].encode())) <= 2  # the rest shared equally
  assert react.fit_observation(docs[:1], max_bytes=1000) == (react.format_observation(docs[:1]),
                                                             False)
  with pytest.raises(ValueError, match="max_bytes"):
    react.fit_observation(docs, max_bytes=10)


def test_token_space_truncation_keeps_the_closing_tag_under_the_policy_tokenizer():
  from trace_jax.envs.worlds.synthetic import build_tokenizer
  from trace_jax.envs.worlds.synthetic_world import SyntheticWorldConfig, generate_world

  world = generate_world(SyntheticWorldConfig(seed=2, n_entities=120, n_train=8, n_test=4))
  tok = build_tokenizer(world)
  encode = lambda s: tok.encode(s).ids
  close = encode(react.INFO_CLOSE)
  env = MultiHopEnv(world.retriever(), topk=3, max_obs_tokens=20, encode=encode)
  queries = [ex.question for ex in world.train[:6]]
  full = [react.format_observation(d) for d in world.retriever().search(queries, 3)]
  assert max(len(encode(t)) for t in full) > 20  # the cap really cuts
  results = env.step_batch([env.reset("x") for _ in queries],
                           [f"<search> {q} </search>" for q in queries])
  for res in results:
    ids = encode(res.observation_text)
    # What a sampler keeping max_obs_tokens tokens would keep is the whole observation.
    assert len(ids) <= 20 and ids[-len(close):] == close
    assert 15 <= len(ids)  # cut close to the budget, not to nothing
  assert env.retriever_stats()["obs_truncated"] == sum(len(encode(t)) > 20 for t in full)
  # The same ids as react.truncate_observation's contract: at most max_tokens, tag last.
  cut = react.truncate_observation(encode(full[0]), 20, close)
  assert len(cut) == 20 and cut[-len(close):] == close


def test_short_observations_are_untouched_by_the_caps():
  env = MultiHopEnv(FixedRetriever(), topk=2, max_obs_bytes=4096, max_obs_tokens=64,
                    encode=str.split)
  [res] = env.step_batch([env.reset("x")], ["<search> q </search>"])
  assert res.observation_text == react.format_observation(DOCS[:2])
  assert env.retriever_stats()["obs_truncated"] == 0


# ----------------------------------------------------------------------------- stats


def test_retriever_stats_count_calls_retries_errors_and_latency_and_reset():
  class FlakyOnce(FixedRetriever):
    failed = False

    def search(self, queries, k):
      if not FlakyOnce.failed:
        FlakyOnce.failed = True
        raise RuntimeError("warming up")
      return super().search(queries, k)

  with serve(FlakyOnce(), "127.0.0.1", 0) as srv:
    env = MultiHopEnv(HTTPRetriever(srv.url, max_retries=2, backoff_s=0.01), topk=2)
    env.step_batch([env.reset("x"), env.reset("y")], ["<search> a </search>"] * 2)
    s = env.retriever_stats(reset=True)
    assert (s["retriever_calls"], s["retriever_queries"], s["retriever_errors"]) == (1, 2, 0)
    assert (s["retriever_retries"], s["retriever_requests"]) == (1, 2)
    assert 0 < s["retriever_latency_mean_s"] <= s["retriever_latency_max_s"] < 5
    zero = env.retriever_stats()
    assert zero["retriever_calls"] == zero["retriever_retries"] == 0
    assert zero["retriever_latency_max_s"] == 0.0
  # The server is gone: the next call is an error, counted, and the rollout continues.
  env.retriever.max_retries, env.retriever.timeout_s = 0, 0.5
  [res] = env.step_batch([env.reset("z")], ["<search> b </search>"])
  assert res.observation_text == react.format_error_observation()
  s = env.retriever_stats(reset=True)
  assert s["retriever_errors"] == 1 and s["retriever_calls"] == 1
  assert env.counters["retriever_errors"] == 1  # the cumulative counter is untouched by resets
  assert set(s) == {"retriever_calls", "retriever_queries", "retriever_errors",
                    "retriever_latency_mean_s", "retriever_latency_max_s", "retriever_retries",
                    "retriever_timeouts", "retriever_requests", "obs_truncated",
                    "obs_docs_dropped"}
  assert all(isinstance(v, (int, float)) for v in s.values())  # JSON-ready


def test_build_env_takes_caps_from_the_config():
  c = mhqa.get_config("smoke")
  c.env.max_obs_bytes, c.env.max_obs_tokens, c.retriever.topk = 512, 30, 3

  class A:
    retriever, encode = FixedRetriever(), staticmethod(str.split)

  env = assets_lib.build_env(c, A)
  assert (env.max_obs_bytes, env.max_obs_tokens, env.topk, env.max_turns) == (512, 30, 3, 5)
  assert env.encode is str.split


# ----------------------------------------------------------------------------- health check


def test_health_check_fails_fast_naming_the_url():
  url = f"http://127.0.0.1:{_free_port()}"
  c = _http_config(url, retries=5, backoff_s=0.2)
  t0 = time.monotonic()
  with pytest.raises(assets_lib.RetrieverHealthError, match=url):
    assets_lib.build_retriever(c)
  assert time.monotonic() - t0 < 1.0  # one retry at most, not the search's five
  with _HungServer() as hung:
    c = _http_config(hung.url, timeout_s=0.2, retries=3, backoff_s=0.05)
    t0 = time.monotonic()
    with pytest.raises(assets_lib.RetrieverHealthError, match="health check"):
      assets_lib.build_retriever(c)
    assert time.monotonic() - t0 < 0.2 * 2 + 0.05 + 0.5


def test_health_check_passes_and_rejects_an_unhealthy_answer():
  with serve(FixedRetriever(), "127.0.0.1", 0) as srv:
    assert assets_lib.build_retriever(_http_config(srv.url)).url == srv.url
  with _RawServer(b'{"status": "loading"}') as srv:
    with pytest.raises(assets_lib.RetrieverHealthError, match="not healthy.*loading"):
      assets_lib.build_retriever(_http_config(srv.url))


def test_launcher_has_request_caps():
  from launch import retrieval_server

  args = retrieval_server.parse_args(["--corpus", "x.jsonl", "--max_queries", "7",
                                      "--max_response_bytes", "4096", "--max_body_bytes", "2048"])
  assert (args.max_queries, args.max_response_bytes, args.max_body_bytes) == (7, 4096, 2048)


def test_training_with_a_dead_retriever_url_exits_nonzero_in_seconds(tmp_path):
  url = f"http://127.0.0.1:{_free_port()}"
  t0 = time.monotonic()
  out = subprocess.run(
      [sys.executable, os.path.join(ROOT, "launch", "train.py"),
       "--config=" + os.path.join(ROOT, "configs", "mhqa.py") + ":smoke",
       "--config.retriever.kind=http", f"--config.retriever.url={url}",
       f"--config.world.cache_dir={tmp_path / 'cache'}", f"--workdir={tmp_path / 'run'}"],
      capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  elapsed = time.monotonic() - t0
  assert out.returncode != 0
  assert "RetrieverHealthError" in out.stderr and url in out.stderr, out.stderr[-2000:]
  assert not (tmp_path / "cache").exists()  # failed before generating the world or training
  assert elapsed < 60, elapsed


def test_new_tool_settings_keep_cached_warm_starts_valid(tmp_path):
  # A run's config without the observation byte cap (as before it existed) has the same warm-start
  # key, and so do other cap and retriever settings: none of them changes the expert traces.

  from trace_jax.config import TrainConfig

  def key_of(c):
    return warm_start_key(TrainConfig.from_dict(c.to_dict()))

  for variant in ("smoke", "tiny"):
    c = mhqa.get_config(variant)
    key = key_of(c)
    old = c.to_dict()
    del old["env"]["max_obs_bytes"]
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert warm_start_key(runs.load_run_config(str(tmp_path))) == key
    c.env.max_obs_bytes, c.retriever.timeout_s, c.retriever.retries = 0, 1.0, 0
    assert key_of(c) == key
    c.env.max_turns += 1  # a setting that does change the traces still changes the key
    assert key_of(c) != key
