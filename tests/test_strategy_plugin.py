"""A method is one module: a strategy defined here, registered by name, trains a step of the real
loop (the smoke world and warm start of `test_train_smoke`) with no other file touched."""

import numpy as np
import pytest

from test_train_smoke import PREFIX_BUDGET, ROOT_BUDGET, smoke_config
from trace_jax.allocation import strategies
from trace_jax.allocation.strategies import RootPlan, Strategy


class DeepestAnchor(Strategy):
  """A toy method: the first prompt gets one rollout, the others share the rest of the root
  budget; stage 2 forks every continuation from the deepest anchor of some tree; trains on GRPO's
  advantage."""
  name = "deepest_anchor"
  advantage = "grpo"

  def root_plan(self, driver, examples, use_predictor):
    counts = np.zeros(len(examples), np.int32)
    counts[0] = 1
    rest = self.cfg.root_budget - 1
    counts[1:] = rest // (len(examples) - 1)
    counts[1:1 + rest % (len(examples) - 1)] += 1
    return RootPlan(counts)

  def prefix_counts(self, driver, trees, cands, use_predictor):
    k = np.zeros(len(cands), np.int32)
    if cands:
      depth = [trees[ti].nodes[nid].depth for ti, nid in cands]
      k[int(np.argmax(depth))] = self.cfg.prefix_budget
    return k, None


@pytest.fixture
def registered():
  strategies.register(DeepestAnchor)
  yield DeepestAnchor
  strategies.unregister(DeepestAnchor.name)
  assert DeepestAnchor.name not in strategies.names()


@pytest.mark.slow
def test_a_registered_toy_strategy_trains_a_step(registered, tmp_path, tmp_path_factory):
  from trace_jax import train

  with pytest.raises(ValueError, match="already registered"):
    strategies.register(type("Clash", (Strategy,), {"name": "grpo"}))
  c = smoke_config(tmp_path_factory, tmp_path / "run", DeepestAnchor.name)
  run = train.build(c)
  assert type(run.driver.strategy) is DeepestAnchor
  state = train.init_state(run)
  sample, rec = train.sample_step(run, state)
  # Its root plan: one rollout for the first prompt, the rest shared by the others.
  first_id = train.step_examples(run, 0)[0]["id"]
  first = [t for t in sample.all_trees if t.meta["id"] == first_id]
  assert [len(t.root.children) for t in first] == [1]
  # Its stage 2: every continuation from one anchor, the deepest candidate.
  assert rec["continuations"] == PREFIX_BUDGET and rec["anchors_used"] == 1
  assert rec["ledger_rollouts_started"] == ROOT_BUDGET + PREFIX_BUDGET
  state, rec = train.update_step(run, state, sample, rec)
  assert state.step == 1 and np.isfinite(rec["loss"]) and rec["finite"] == 1.0
