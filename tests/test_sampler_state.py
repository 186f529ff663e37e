"""The sampler's host-side state does not grow with the number of sampling rounds.

A training run calls `run` (prompts, then forks from their anchors) and `release` once per RL step
for days: everything the engine, the process wrapper and the environment adapter hold must come
back to its size after the first round (trees, their records, pages, per-step instrumentation,
queues, prefill jobs, caches), and a `Tree` must carry no engine state.
"""

import collections

import jax
import pytest

from test_sampler import PROMPTS, TOK, V, model  # noqa: F401 (fixture)
from trace_jax.envs.adapter import TreeEnvAdapter
from trace_jax.parallel import make_mesh
from trace_jax.sampling.engine import ForkRequest, PromptRequest, SamplerConfig, SamplerEngine
from trace_jax.sampling.multiprocess import ProcessShardedEngine

ROUNDS = 30


class TurnEnv:
  """Stateful env (its state counts turns): each turn's observation depends on the turn text; the
  rollout ends at its third turn or on an answer."""

  class Result:
    def __init__(self, obs, done, reward):
      self.observation_text, self.done, self.reward, self.info = obs, done, reward, {"n": 1}

  def reset(self, golds, example_id=""):
    return {"turns": 0}

  def step_batch(self, states, texts):
    out = []
    for s, text in zip(states, texts):
      s["turns"] += 1
      done = s["turns"] >= 3 or "</answer>" in text
      words = " ".join(f"w{8 + (len(text) + 3 * k) % (V - 8)}" for k in range(4))
      out.append(self.Result(None if done else words, done, float(done)))
    return out


def _sizes(obj) -> dict:
  """len() of every container attribute of `obj` (what could grow round after round)."""
  return {k: len(v) for k, v in vars(obj).items()
          if isinstance(v, (list, dict, set, tuple, collections.deque))}


@pytest.mark.parametrize("wrapped", [False, True])
def test_host_state_stays_flat_over_rounds(model, wrapped):  # noqa: F811
  adapter = TreeEnvAdapter(TurnEnv())
  cfg = SamplerConfig(num_slots=4, page_size=4, num_pages=256, max_seq_len=64, max_turn_tokens=5,
                      max_obs_tokens=6, max_turns=3, prefill_chunk=(16,), page_buckets=(16,),
                      greedy=False, max_group_size=2, max_groups=2, prompt_mean_features=True)
  inner = SamplerEngine(model[0], model[1], cfg, TOK.encode, TOK.decode, adapter, eos_id=1,
                        observation_close="w9")
  engine = (ProcessShardedEngine(inner, make_mesh("data:1", devices=jax.devices()[:1]))
            if wrapped else inner)
  free0 = inner.alloc.num_free
  sizes = []
  for r in range(ROUNDS):
    engine.set_uid_base((r + 1) << 20)  # as the train loop numbers each step's trees
    reqs = [PromptRequest(PROMPTS[(r + i) % len(PROMPTS)], n=2, meta={"golds": ["x"]})
            for i in range(2)]
    trees = engine.run(reqs)
    forks = [ForkRequest(t, a.id, 1) for t in trees for a in t.anchors() if a.depth == 1]
    engine.run(forks[:3])
    # A round of continuations dropped again: its nodes and pages go, the tree stays forkable.
    mark = inner.checkpoint(trees[0])
    engine.run([ForkRequest(trees[0], 0, 1)])
    inner.rollback(trees[0], mark)
    assert len(trees[0].nodes) == mark[0]
    assert all(set(vars(t)) == {"uid", "meta", "nodes"} for t in trees)  # no engine state
    assert len(inner.live_trees) == len(trees) and adapter.states
    assert inner.alloc.num_free < free0
    engine.release(trees)
    # Everything the round held is gone.
    assert not inner.live_trees and not inner._trees
    assert inner.alloc.num_free == free0 and not inner.alloc.refcount.any()
    assert not inner.step_log and not inner.starts  # instrumentation off by default
    assert all(b is None for b in inner.slots) and not inner._jobs
    assert not any(inner._pending.values())
    assert not adapter.states and not adapter.infos
    if wrapped:
      assert not engine._owner and not engine._copies
    sizes.append((_sizes(inner), _sizes(adapter), _sizes(engine)))
  assert inner.ledger.rollouts_started >= ROUNDS * 6 and inner.ledger.tool_calls > ROUNDS
  # No container of the engine, the adapter or the wrapper grows once every prompt has been seen
  # (the prompt-mean cache holds the few distinct prompts).
  warm = len(PROMPTS) - 1
  for later in sizes[warm:]:
    grew = {k: (a[k], b.get(k)) for a, b in zip(sizes[warm], later) for k in a if a[k] != b.get(k)}
    assert not grew, grew
