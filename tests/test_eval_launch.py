"""`launch/eval.py`: a training run's checkpoint or a HF checkpoint, on the synthetic world's test
split or on QA files, with EM/F1 per source and averaged in the JSON it writes.

The training run is the smoke run of `tests/test_train_smoke.py` (made once per session).
"""

import json
import os

import numpy as np
import pytest

from test_train_smoke import launch, smoke_run

from trace_jax.envs.worlds.synthetic import World

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  return smoke_run(tmp_path_factory)


def _world(run):
  return World.load(os.path.join(run["cache"], "world-seed0"))


def _check(res, n_expected, sources):
  for k in ("em", "f1", "n", "per_source", "macro", "em_by_hops", "checkpoint", "data",
            "retriever"):
    assert k in res, k
  assert res["n"] == n_expected
  assert set(res["per_source"]) == set(sources)
  for v in [res, res["macro"], *res["per_source"].values()]:
    assert 0.0 <= v["em"] <= 1.0 and 0.0 <= v["f1"] <= 1.0 and v["em"] <= v["f1"] + 1e-9
  assert sum(v["n"] for v in res["per_source"].values()) == n_expected
  np.testing.assert_allclose(res["macro"]["em"],
                             np.mean([v["em"] for v in res["per_source"].values()]))
  np.testing.assert_allclose(
      res["em"], sum(v["em"] * v["n"] for v in res["per_source"].values()) / n_expected)


def test_eval_run_on_world_test_split(run, tmp_path):
  out = tmp_path / "eval.json"
  p = launch("eval.py", f"--workdir={run['workdir']}", "--limit=4", f"--out={out}")
  assert p.returncode == 0, p.stdout[-3000:]
  res = json.loads(out.read_text())
  _check(res, 4, {"synthetic"})
  assert res["checkpoint"]["step"] == 3  # the latest
  assert res["retriever"] == "world" and res["data"][0]["format"] == "synthetic_world_test"
  assert res["em_by_hops"] and all(0 <= v <= 1 for v in res["em_by_hops"].values())
  # the world's test questions split by whether their entity appears in a train question
  assert set(res["em_by_seen"]) <= {"seen", "unseen"} and res["em_by_seen"]


def test_eval_run_on_flashrag_files(run, tmp_path):
  """Two FlashRAG jsonl files of world questions (by hops): two sources, world retriever."""
  w = _world(run)
  paths = []
  for hops in (2, 3):
    path = tmp_path / f"hops{hops}.jsonl"
    with open(path, "w") as f:
      for e in [e for e in w.test if e.hops == hops][:3]:
        f.write(json.dumps({"id": e.id, "question": e.question,
                            "golden_answers": list(e.answers)}) + "\n")
    paths.append(str(path))
  out = tmp_path / "eval.json"
  p = launch("eval.py", f"--workdir={run['workdir']}", "--step=2", f"--data={','.join(paths)}",
             "--format=flashrag", "--retriever=world", f"--out={out}")
  assert p.returncode == 0, p.stdout[-3000:]
  res = json.loads(out.read_text())
  _check(res, 6, {"hops2", "hops3"})
  assert res["checkpoint"]["step"] == 2
  assert [d["format"] for d in res["data"]] == ["flashrag", "flashrag"]


@pytest.mark.parametrize("retriever", ["bm25", "http"])
def test_eval_hf_checkpoint(run, tmp_path, retriever):
  """A HF-layout checkpoint with its tokenizer in the same directory; BM25 over a jsonl corpus,
  or a retrieval server (in this process) answering over HTTP."""
  from flax import nnx

  from trace_jax.envs.retrieval.http_client import serve
  from trace_jax.envs.retrieval.bm25 import BM25Retriever, write_corpus_jsonl
  from trace_jax.envs.worlds.synthetic import build_hf_tokenizer
  from trace_jax.models.qwen3 import Qwen3, get_preset
  from trace_jax.models.qwen3.params import save_pretrained

  w = _world(run)
  tok = build_hf_tokenizer(w)
  ckpt = tmp_path / "hf"
  save_pretrained(Qwen3(get_preset("tiny", vocab_size=len(tok), num_layers=1),
                        rngs=nnx.Rngs(0)), str(ckpt))
  tok.save_pretrained(str(ckpt))
  corpus = tmp_path / "corpus.jsonl"
  write_corpus_jsonl(w.corpus[:200], str(corpus))
  data = tmp_path / "bamboogle.jsonl"
  data.write_text("".join(json.dumps({"Question": e.question, "Answer": e.answers[0]}) + "\n"
                          for e in w.test[:2]))
  out = tmp_path / "eval.json"
  server = serve(BM25Retriever.from_jsonl(str(corpus)), port=0) if retriever == "http" else None
  spec = f"http:{server.url}" if server else f"bm25:{corpus}"
  try:
    p = launch("eval.py", f"--model_path={ckpt}", f"--data={data}", f"--retriever={spec}",
               "--dtype=float32", "--max_turns=2", "--max_turn_tokens=8", "--max_obs_tokens=16",
               "--max_seq_len=256", "--num_slots=2", "--num_pages=128", "--topk=1",
               f"--out={out}")
  finally:
    if server:
      server.close()
  assert p.returncode == 0, p.stdout[-3000:]
  res = json.loads(out.read_text())
  _check(res, 2, {"bamboogle"})
  assert res["checkpoint"]["model_path"] == str(ckpt)
  assert res["retriever"] == spec


@pytest.mark.parametrize("args,message", [
    ((), "exactly one of --workdir"),
    (("--workdir=/no/such/run",), "does not exist"),
    (("--model_path=/no/such/ckpt",), "does not exist"),
    (("--workdir={w}", "--data=/no/such.jsonl"), "does not exist"),
    (("--workdir={w}", "--step=99"), "saved steps: [2, 3]"),
    (("--workdir={w}", "--retriever=bm25:/no/such/index"), "no such index"),
    (("--workdir={w}", "--retriever=elastic"), "expected world, bm25:PATH or http:URL"),
])
def test_eval_clear_errors(run, args, message):
  """Bad arguments fail before any model is built."""
  p = launch("eval.py", *[a.format(w=run["workdir"]) for a in args], timeout=120)
  assert p.returncode != 0 and message in p.stdout, p.stdout[-2000:]


def test_probe_a_trained_run(run, tmp_path):
  """`projects/mhqa/probe_warm_start.py --workdir`: the run's policy (its config and latest
  checkpoint),
  greedy on the test split as its trees (whose EM is the evaluation's) and sampled in groups on
  train prompts, with the outcome breakdown of every rollout."""
  out = tmp_path / "probe.json"
  p = launch("projects/mhqa/probe_warm_start.py", f"--workdir={run['workdir']}", "--prompts=3",
             "--temperatures=1.0", "--offline_fit=false", f"--out={out}")
  assert p.returncode == 0, p.stdout[-3000:]
  res = json.loads(out.read_text())
  assert res["policy"] == {"workdir": run["workdir"], "step": 3}
  g = res["greedy"]
  assert g["n"] == 4 and g["outcomes"]["rollouts"] == 4
  assert g["outcomes"]["success"] == pytest.approx(g["em"])  # the same greedy rollouts
  assert len(g["per_question"]) == 4
  assert sum(b["questions"] for b in g["by_seen"].values()) == 4
  assert sum(k == "success" for k in g["per_question"].values()) == round(4 * g["em"])
  s = res["temperatures"]["1.0"]
  assert s["outcomes"]["rollouts"] == 3 * 8
  assert s["outcomes"]["success"] == pytest.approx(s["sampled_success"])
  for o in (g["outcomes"], s["outcomes"]):
    assert sum(o[k] for k in ("success", "no_answer", "misled", "wrong_entity", "search_missed",
                              "wrong_answer")) == pytest.approx(1.0)
  assert "offline_predictor" not in s
