"""Task-affine workers and synchronous turns: same samples, affinity respected, utilization."""

import numpy as np
import pytest
from flax import nnx

from trace_jax.models.qwen3 import Qwen3, get_preset
from trace_jax.sampling.engine import PromptRequest, SamplerConfig, SamplerEngine
from trace_jax.sampling.scheduler import run_synchronous, run_task_affine, utilization_report
from trace_jax.sampling.testing import IdTokenizer, LongTailEnv

V = 64
TOK = IdTokenizer()


@pytest.fixture(scope="module")
def model():
  return nnx.split(Qwen3(get_preset("tiny", vocab_size=V), rngs=nnx.Rngs(0)))


def turn_limit(tree, rollout, depth):
  """Long-tailed, deterministic turn lengths: most turns short, a few near the cap."""
  rng = np.random.default_rng([tree.uid, rollout, depth])
  return int(2 + rng.pareto(1.2) * 3)


def make_engine(model, slots=8, record_steps=100_000):
  cfg = SamplerConfig(num_slots=slots, page_size=8, num_pages=2048, max_seq_len=192,
                      max_turn_tokens=24, max_obs_tokens=8, max_turns=6, prefill_chunk=(16,),
                      page_buckets=(24,), seed=1)
  return SamplerEngine(model[0], model[1], cfg, TOK.encode, TOK.decode,
                       LongTailEnv(V, seed=0, mean_turns=1.0, max_turns=6), eos_id=None,
                       stop_strings=(), turn_limit_fn=turn_limit, record_steps=record_steps)


def requests(n_prompts=12, n=4):
  rng = np.random.default_rng(0)
  return [PromptRequest(list(rng.integers(8, V, 5)), n=n) for _ in range(n_prompts)]


def leaf_sets(trees):
  return [sorted(tuple(t.path_tokens(x.id)[0]) for x in t.leaves()) for t in trees]


def test_modes_sample_the_same_trees_and_affinity_holds(model):
  runs = {}
  for name, fn in [("w1", lambda e: run_task_affine(e, requests(), 1)),
                   ("w4", lambda e: run_task_affine(e, requests(), 4)),
                   ("sync", lambda e: run_synchronous(e, requests())),
                   ("sync_refill", lambda e: run_synchronous(e, requests(), refill=True))]:
    engine = make_engine(model)
    trees, report = fn(engine)
    runs[name] = (engine, trees, report)
  # Per-branch rng keys make the samples independent of slot placement and timing.
  sets = [leaf_sets(r[1]) for r in runs.values()]
  assert all(x == sets[0] for x in sets)
  engine, trees, report = runs["w4"]
  worker = {t.uid: engine.tree_state(t).worker for t in trees}
  assert sorted(set(worker.values())) == [0, 1, 2, 3]
  assert len(engine.starts) == engine.ledger.rollouts_started
  assert all(engine.slot_worker[slot] == worker[uid] for slot, uid in engine.starts)
  assert report.num_workers == 4 and len(report.worker_utilization) == 4
  # Synchronous turns idle the slots waiting for the slowest turn; continuous refill does not.
  r1, rs, rr = runs["w1"][2], runs["sync"][2], runs["sync_refill"][2]
  assert rs.utilization < rr.utilization < r1.utilization
  assert rs.idle_slot_steps > r1.idle_slot_steps
  for _, _, r in runs.values():
    assert r.generated_tokens == r1.generated_tokens
    assert 0 < r.utilization <= 1
    assert r.busy_slot_steps <= r.decode_steps * r.num_slots


def test_forks_stay_with_their_worker(model):
  engine = make_engine(model)
  trees, _ = run_task_affine(engine, requests(6, 2), 3)
  n_starts = len(engine.starts)
  worker0 = {t.uid: engine.tree_state(t).worker for t in trees}
  forks = [(t, a.id, 2) for t in trees for a in t.anchors()[:2]]
  trees2, report = run_task_affine(engine, forks, 3)
  worker = {t.uid: engine.tree_state(t).worker for t in trees2}
  assert all(worker[uid] == worker0[uid] for uid in worker)
  assert len(engine.starts) > n_starts
  assert all(engine.slot_worker[slot] == worker[uid]
             for slot, uid in list(engine.starts)[n_starts:])
  assert report.decode_steps > 0
  engine.release()
  assert engine.alloc.num_free == engine.alloc.capacity


def test_step_log_is_opt_in_and_bounded(model):
  # Off by default (a training run never reads it); on, it keeps the last `record_steps` rows.
  off = make_engine(model, record_steps=0)
  off.run(requests(2, 2))
  assert off.ledger.decode_steps > 0 and not off.step_log and not off.starts
  with pytest.raises(ValueError, match="record_steps"):
    run_task_affine(off, requests(2, 2))
  small = make_engine(model, record_steps=5)
  small.run(requests(4, 2))  # 8 branch starts, more decode steps
  assert small.ledger.decode_steps > 5 and len(small.step_log) == len(small.starts) == 5
  with pytest.raises(RuntimeError, match="larger record_steps"):  # not a report on part of a run
    run_task_affine(small, requests(2, 2))


def test_utilization_report_arithmetic(model):
  engine = make_engine(model, slots=4)
  engine.slot_worker = np.asarray([0, 0, 1, 1])
  engine.step_log = [np.asarray(r) for r in ([2, 2], [2, 1], [1, 0], [1, 0], [0, 1])]
  r = utilization_report(engine, 0, "x", 2)
  assert r.decode_steps == 5 and r.busy_slot_steps == 10
  assert r.utilization == pytest.approx(0.5)
  assert r.worker_utilization == pytest.approx([0.6, 0.4])
  assert r.idle_slot_steps == 10
  assert r.tail_steps == 3  # steps 2..4 have fewer than half the slots busy
  assert r.worker_done_step == [3, 4]


class CountingEnv:
  """Stateful env: the state counts turns; the rollout ends at turn 3 with reward = turns seen."""

  class State:
    def __init__(self, golds):
      self.golds, self.turn = golds, 0

  class Result:
    def __init__(self, obs, done, reward):
      self.observation_text, self.done, self.reward, self.info = obs, done, reward, {}

  def reset(self, golds, example_id=""):
    return self.State(golds)

  def step_batch(self, states, texts):
    out = []
    for s in states:
      s.turn += 1
      out.append(self.Result(None if s.turn >= 3 else "w9 w10 w11", s.turn >= 3, float(s.turn)))
    return out


def test_env_adapter_forks_env_state(model):
  from trace_jax.envs.adapter import TreeEnvAdapter
  adapter = TreeEnvAdapter(CountingEnv())
  cfg = SamplerConfig(num_slots=4, page_size=8, num_pages=512, max_seq_len=96, max_turn_tokens=4,
                      max_obs_tokens=8, max_turns=6, prefill_chunk=(16,), page_buckets=(12,))
  engine = SamplerEngine(model[0], model[1], cfg, TOK.encode, TOK.decode, adapter, eos_id=None,
                         stop_strings=())
  trees = engine.run([PromptRequest([3, 4, 5], n=2, meta={"golds": ["x"]})])
  engine.run([(trees[0], a.id, 2) for a in trees[0].anchors() if a.depth == 1])
  leaves = trees[0].leaves()
  assert len(leaves) == 2 + 2 * 2
  # A fork continues from its anchor's env state: the turn count runs on along the path.
  assert all(leaf.depth == 3 and leaf.reward == 3.0 for leaf in leaves)
  adapter.release(trees)
  engine.release(trees)
  assert not adapter.states and engine.alloc.num_free == engine.alloc.capacity
