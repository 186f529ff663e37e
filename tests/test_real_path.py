"""The real-checkpoint path end to end, with nothing downloaded: a random tiny HF `Qwen3ForCausalLM`
and a BPE tokenizer trained on the spot (`tests/real_assets.py`), Search-R1 parquet data and a
jsonl corpus served by `launch/retrieval_server.py`; `launch/train.py` with the `real_smoke`
variant (bf16 params) as two JAX processes on 127.0.0.1, 4 CPU devices each, one global mesh
data:2,fsdp:2,tensor:2, for two steps with process 1's first retriever calls failing; a resume of
both to a third step; then `launch/eval.py` on the checkpoint on the same mesh (one process, 8
devices) and on one device.

A tool failure on one host must not desynchronize the pod: the failed searches become error
observations in that process's trees, both processes still issue the same device programs, and the
run's records count the errors of both processes.

The fast tests at the bottom pin the fixes this path needed.
"""

import json
import math
import os
import subprocess
import sys
import time
import urllib.request

import pytest
from test_multiprocess_train import launch_pair
from test_train_smoke import ROOT, launch

MESH = "data:2,fsdp:2,tensor:2"
FAILED_SEARCHES = 2  # process 1's first retriever calls that fail (tests/faults.py)


# ---- the retrieval server ------------------------------------------------------------------------
class RetrievalServer:
  """`launch/retrieval_server.py --port 0` in a subprocess; `url` once its /health answers."""

  def __init__(self, corpus: str, log_path: str, timeout: float = 60.0):
    self.log_path = log_path
    self._out = open(log_path, "w")
    self.proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "launch", "retrieval_server.py"), "--corpus", corpus,
         "--port", "0", "--log_level", "WARNING"], cwd=ROOT, stdout=self._out,
        stderr=subprocess.STDOUT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    try:
      self.url = self._wait(timeout)
    except BaseException:
      self.close()
      raise

  def _wait(self, timeout):
    t_end, url = time.time() + timeout, None
    while time.time() < t_end:
      if self.proc.poll() is not None:
        raise RuntimeError(f"retrieval server exited ({self.proc.returncode}): {self.log()}")
      if url is None:
        for line in self.log().splitlines():
          if line.startswith("serving ") and " on http://" in line:
            url = line.rsplit(" on ", 1)[1].strip()
      if url is not None:
        try:
          with urllib.request.urlopen(url + "/health", timeout=2) as r:
            if json.loads(r.read()).get("status") == "ok":
              return url
        except OSError:
          pass
      time.sleep(0.2)
    raise TimeoutError(f"retrieval server not healthy after {timeout}s: {self.log()}")

  def log(self) -> str:
    with open(self.log_path) as f:
      return f.read()[-3000:]

  def close(self):
    if self.proc.poll() is None:
      self.proc.terminate()
      try:
        self.proc.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()
    self._out.close()


# ---- the run, made once per module ---------------------------------------------------------------
def train_args(assets, url, workdir, steps):
  return ["--config=configs/mhqa.py:real_smoke", f"--workdir={workdir}",
          f"--config.model.path={assets['model']}", f"--config.data.train_path={assets['train']}",
          f"--config.data.test_path={assets['test']}", f"--config.retriever.url={url}",
          f"--config.mesh={MESH}", f"--config.rl.steps={steps}"]


def _records(workdir):
  return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]


def _errors(recs):
  """Failed retriever calls over records: RL steps' and evaluations' (each summed over the
  processes)."""
  return sum(r.get("retriever_errors", 0) + r.get("eval_retriever_errors", 0) for r in recs)


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
  from real_assets import make_real_assets

  t0 = time.time()
  base = str(tmp_path_factory.mktemp("real"))
  assets = make_real_assets(os.path.join(base, "assets"))
  server = RetrievalServer(assets["corpus"], os.path.join(base, "server.log"))
  times = dict(assets=time.time() - t0)
  try:
    workdir = os.path.join(base, "run")
    t = time.time()
    first = launch_pair(base, train_args(assets, server.url, workdir, 2),
                        [f"--retriever_errors=1:{FAILED_SEARCHES}"],
                        name="steps2")
    recs2, summary2 = _records(workdir), json.load(open(os.path.join(workdir, "summary.json")))
    times["train"] = time.time() - t
    t = time.time()
    second = launch_pair(base, train_args(assets, server.url, workdir, 3), name="steps3")
    times["resume"] = time.time() - t
    t = time.time()
    out = os.path.join(base, "eval.json")
    ev = launch("eval.py", f"--workdir={workdir}", f"--data={assets['test']}",
                f"--retriever=http:{server.url}", f"--mesh={MESH}", "--limit=4", f"--out={out}",
                devices=8)
    assert ev.returncode == 0, ev.stdout[-4000:]
    times["eval"] = time.time() - t
  finally:
    server.close()
  times["total"] = time.time() - t0
  print(f"real path timings (s): {json.dumps({k: round(v, 1) for k, v in times.items()})}")
  return dict(assets=assets, workdir=workdir, first=first, second=second, recs2=recs2,
              summary2=summary2, recs3=_records(workdir),
              summary3=json.load(open(os.path.join(workdir, "summary.json"))),
              eval=json.load(open(out)), eval_stdout=ev.stdout, times=times)


@pytest.mark.slow
def test_real_path_trains_two_steps_on_two_processes(real_run):
  s, recs = real_run["summary2"], real_run["recs2"]
  assert s["variant"] == "real_smoke" and s["steps"] == 2
  out0, out1 = real_run["first"]
  assert "16 train / 8 test prompts" in out0
  assert "warm start" not in out0  # real data: no synthetic warm start
  rl = [r for r in recs if "loss" in r]
  assert [r["step"] for r in rl] == [1, 2]  # one writer: each step recorded once
  for r in rl:
    assert math.isfinite(r["loss"]) and r["finite"] == 1.0 and r["skipped_steps"] == 0
    assert math.isfinite(r["kl_ref"])
    assert r["grad_norm"] > 0  # the entropy term trains the policy even without reward
    # train_rows=4 rounded up to micro_batches x minibatches x (data x fsdp) = 2 x 2 x 4
    assert r["batch_padded_rows"] == 16
  assert sum(r["retriever_queries"] for r in rl) > 0  # the policy searched over HTTP
  # Process 1's retriever failed, process 0's did not; both ran to the end, and process 0's records
  # count every injected error (in the step-0 evaluation or an RL step).
  assert "injected retriever error" in out1 and "injected retriever error" not in out0
  assert _errors(recs) == FAILED_SEARCHES
  assert s["rollouts"] == 2 * (4 + 2) and s["generated_tokens"] > 0
  assert {"0", "2"} <= set(s["evals"]) and all(0 <= v <= 1 for v in s["evals"].values())
  assert "slot_utilization" in out0 and "slot_utilization" not in out1  # one summary printed
  cfg = json.load(open(os.path.join(real_run["workdir"], "config.json")))
  assert cfg["model"]["param_dtype"] == "bfloat16" and cfg["mesh"] == MESH


@pytest.mark.slow
def test_real_path_resumes_a_third_step_on_both_processes(real_run):
  for out in real_run["second"]:
    assert "resumed at step 2" in out, out[-3000:]
  assert _errors(real_run["recs3"]) == FAILED_SEARCHES  # the resumed pair ran without the fault
  rl = [r["step"] for r in real_run["recs3"] if "loss" in r]
  assert rl == [1, 2, 3]  # step 3 added, steps 1-2 not repeated
  assert [r["step"] for r in real_run["recs3"] if "eval_em" in r] == [0, 2, 3]
  s = real_run["summary3"]
  assert s["steps"] == 3 and s["rollouts"] == 3 * (4 + 2)
  assert s["generated_tokens"] > real_run["summary2"]["generated_tokens"]
  ckpts = os.listdir(os.path.join(real_run["workdir"], "checkpoints"))
  assert {"2", "3"} <= set(ckpts)


@pytest.mark.slow
def test_real_path_eval_on_the_mesh(real_run):
  res = real_run["eval"]
  assert res["checkpoint"]["step"] == 3 and res["n"] == 4
  assert set(res["per_source"]) == {"madeup_qa"}
  assert res["data"][0]["format"] == "searchr1" and res["data"][0]["kept"] == 8
  assert 0 <= res["em"] <= res["f1"] + 1e-9 <= 1 + 1e-9
  assert res["mean_turns"] >= 1 and res["generated_tokens"] > 0
  # the sampler ran the bf16 policy (masters cast as in training), split over the 8 devices
  pol = res["policy"]
  assert pol["dtypes"] == ["bfloat16"]
  assert pol["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
  assert 0 < pol["sharded"] <= pol["arrays"]
  assert "madeup_qa: EM" in real_run["eval_stdout"]


@pytest.mark.slow
def test_real_path_eval_on_one_device(real_run, tmp_path):
  """The checkpoint saved on 8 devices restores on one (a target placed on that device), here with
  BM25 over the same corpus in-process instead of the server."""
  out = tmp_path / "eval.json"
  p = launch("eval.py", f"--workdir={real_run['workdir']}", f"--data={real_run['assets']['test']}",
             f"--retriever=bm25:{real_run['assets']['corpus']}", "--mesh=data:1", "--limit=2",
             f"--out={out}")
  assert p.returncode == 0, p.stdout[-3000:]
  res = json.loads(out.read_text())
  assert res["checkpoint"]["step"] == 3 and res["n"] == 2
  assert res["policy"]["dtypes"] == ["bfloat16"] and res["policy"]["sharded"] == 0
  assert res["policy"]["mesh"] == {"data": 1, "fsdp": 1, "tensor": 1}


# ---- the fixes the real path needed --------------------------------------------------------------
def _config(variant):
  from configs import mhqa
  return mhqa.get_config(variant)


def test_real_smoke_variant_is_the_qwen3_path_at_toy_size():
  from trace_jax.assets import uses_real_data

  c = _config("real_smoke")
  assert uses_real_data(c) and uses_real_data(_config("qwen3_8b"))
  assert not uses_real_data(_config("smoke")) and not uses_real_data(_config("tiny"))
  assert c.model.param_dtype == "bfloat16" and c.retriever.kind == "http"
  assert c.rl.steps == 2 and c.ckpt.every == 1 and c.eval.size <= 8
  assert c.env.max_seq_len <= 512 and c.rollout.prompts_per_step <= 4
  assert c.model.path == ""  # given on the command line


def test_prompt_plan_with_fewer_train_questions_than_probe_prompts():
  """A real train set smaller than eval.probe_prompts (32) used to fail at the first RL step."""
  import numpy as np

  from trace_jax.train import prompt_plan

  probe, order = prompt_plan(0, 32, 16)
  assert sorted(order.tolist()) == list(range(16)) and len(set(probe.tolist())) == 16
  # unchanged where the train set is large enough: same draws as before the fix
  rng = np.random.default_rng(7)
  p0 = rng.choice(100, 8, replace=False)
  probe, order = prompt_plan(7, 8, 100)
  assert probe.tolist() == p0.tolist() and order.tolist() == rng.permutation(100).tolist()


def test_update_rows_split_evenly_into_sharded_micro_batches():
  """Rows per update must be a multiple of micro_batches x (data x fsdp): lcm(2, 4) = 4 rows could
  not be split into 2 micro-batches over 4 row shards."""
  from jax.sharding import AbstractMesh

  from trace_jax.train import update_rows

  c = _config("real_smoke")
  mesh = AbstractMesh((2, 2, 2), ("data", "fsdp", "tensor"))
  c.rl.train_rows, c.rl.micro_batches, c.rl.minibatches = 4, 2, 1
  assert update_rows(c, mesh) == 8
  c.rl.train_rows = 9
  assert update_rows(c, mesh) == 16
  c.rl.micro_batches = 1
  assert update_rows(c, AbstractMesh((1, 1, 1), ("data", "fsdp", "tensor"))) == 9
  assert update_rows(c, AbstractMesh((1, 1, 8), ("data", "fsdp", "tensor"))) == 9
  assert update_rows(c, AbstractMesh((8, 1, 1), ("data", "fsdp", "tensor"))) == 16


def test_largest_tree_and_the_plan_pad_rows_as_the_loop_does():
  """The build-time pool check sizes the largest tree a run starts (stage 1's cap bounded by the
  budget, GRPO's groups, the probe's 8); the memory plan pads rows as `update_rows` does."""
  from trace_jax.parallel.micro_batch import padded_rows
  from trace_jax.train import largest_tree

  c = _config("real_smoke")
  assert largest_tree(c) == 8  # the probe: root_budget 4 over 2 prompts leaves a cap of 4
  c.eval.probe_prompts = 0
  # stage 1: min(cap 4, 4 - 1 x min_per_prompt) vs GRPO's group (4 + 2) / 2 = 3
  assert largest_tree(c) == max(3, min(4, 4 - c.rollout.min_per_prompt))
  c.rollout.root_budget, c.rollout.max_per_prompt = 40, 32
  assert largest_tree(c) == min(32, 40 - c.rollout.min_per_prompt)
  assert padded_rows(512, 32, 64) == 2048 and padded_rows(512, 32, 4) == 512
  assert padded_rows(3, 1, 1) == 3 and padded_rows(0, 2, 2) == 4
