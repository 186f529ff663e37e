"""The estimates' options end to end on the smoke run's warm start: PPO epochs and minibatches,
the posterior and discovery root objectives, anchors before a tool call, the slice counted in the
ledger when it steers, and the head fit on the slice with a holdout and an ensemble (with stage 2
streamed, so the options are checked together)."""


import numpy as np
import pytest
from test_train_smoke import draw_outcomes, smoke_config

from configs import mhqa
from trace_jax.allocation import strategies
from trace_jax.allocation.driver import driver_config
from trace_jax.sampling.tree import Tree


def _config(tmp_path, tmp_path_factory, method="trace_tree", **sections):
  return smoke_config(tmp_path_factory, tmp_path / "run", method, **sections)


def test_minibatch_order_covers_every_row_once_per_epoch():
  from trace_jax.train import minibatch_order

  groups = minibatch_order(12, 3, 2, seed=0, step=5)
  assert len(groups) == 6 and all(len(g) == 4 for g in groups)
  for epoch in (groups[:3], groups[3:]):
    np.testing.assert_array_equal(np.sort(np.concatenate(epoch)), np.arange(12))
  assert any(not np.array_equal(a, b) for a, b in zip(groups[:3], groups[3:]))  # reshuffled
  again = minibatch_order(12, 3, 2, seed=0, step=5)  # a resumed step repeats its order
  assert all(np.array_equal(a, b) for a, b in zip(groups, again))
  np.testing.assert_array_equal(minibatch_order(8, 1, 2, 0, 0)[1], np.arange(8))


def test_slice_counts_in_the_ledger_only_when_it_steers():
  c = mhqa.validate(mhqa.get_config("tiny"))
  assert not driver_config(c).count_slice
  assert driver_config(c.replace(rollout=c.rollout.__class__(
      **{**c.rollout.__dict__, "calibrate": "platt"}))).count_slice
  assert driver_config(c.replace(rl=c.rl.__class__(
      **{**c.rl.__dict__, "predictor_slice": True}))).count_slice


def _chain(tree, parent, turns):
  """Adds a rollout of `turns` turns below `parent`; the last is a leaf (the answer)."""
  node = parent
  for t in range(turns):
    last = t == turns - 1
    node = tree.add_node(node, gen_ids=[1, 2], obs_ids=[] if last else [7], done=last,
                         reward=0.0 if last else None).id
  return node


def test_anchors_before_tool_call_skip_boundaries_after_the_last_call():
  cfg = driver_config_of(anchors="before_tool_call")
  strat = strategies.get("trace_tree")(cfg)
  t = Tree(prompt_ids=[1, 2, 3])
  _chain(t, 0, 3)  # turns 1, 2 call a tool, turn 3 answers
  every = strategies.get("trace_tree")(driver_config_of(anchors="all")).candidates([t])
  kept = strat.candidates([t])
  depths = {nid: t.nodes[nid].depth for _, nid in every}
  # Boundaries after turn 1 (a call follows) and after turn 2 (only the answer follows).
  assert sorted(depths.values()) == [0, 1, 2]  # the root of an unmixed tree is an anchor too
  assert sorted(t.nodes[nid].depth for _, nid in kept) == [0, 1]


def driver_config_of(**kw):
  from trace_jax.allocation.driver import DriverConfig

  return DriverConfig(method="trace_tree", **kw)


@pytest.mark.slow
def test_one_step_with_every_estimate_option(tmp_path, tmp_path_factory):
  from trace_jax import train

  c = _config(tmp_path, tmp_path_factory, rl__ppo_epochs=2, rl__minibatches=2, rl__lr=1e-3,
              rollout__root_objective="discovery", rollout__anchors="before_tool_call",
              rollout__metric_slice=2, rollout__calibrate="platt", rl__predictor_slice=True,
              rl__predictor_holdout=0.25, rl__predictor_ensemble=3, rl__tree_values="children",
              rollout__stage2="stream")
  run = train.build(c)
  assert run.driver.cfg.count_slice
  state = train.init_state(run)
  sample, rec = train.sample_step(run, state)
  assert run.driver.predict_spread is not None
  assert rec["slice_counted"] == 1.0 and rec["slice_rollouts_started"] > 0
  # The ledger holds the slice: stage 1 + stage 2 + the slice's rollouts.
  assert rec["ledger_rollouts_started"] > c.rollout.root_budget
  assert "root_concentration_mean" in rec and "stage1_posterior_mixed" in rec
  assert rec["stage2_streamed"] == 1.0 and rec["stage2_decisions"] >= 1
  draw_outcomes(sample.trees)  # so the policy gradient is not zero and the policy moves
  state, rec = train.update_step(run, state, sample, rec)
  assert rec["optimizer_steps"] == 4.0
  assert np.isfinite(rec["loss"]) and rec["finite"] == 1.0
  # After the first update the policy has moved off the sampler's: the ratio is no longer 1.
  assert rec["approx_kl_last"] > rec["approx_kl_first"] >= 0.0
  assert rec["predictor_fit_members"] == 3 and rec["predictor_fit_rows"] > 0
  # The fit held out the prompts whose hash falls in the share (the smoke step has a few).
  from trace_jax.allocation.predictor_fit import held_out
  held = [t for t in sample.all_trees + sample.slice_trees if held_out(t.prompt_ids, 0.25)]
  assert (rec.get("predictor_fit_holdout_rows", 0) > 0) == bool(held)


@pytest.mark.slow
def test_only_methods_that_read_the_predictor_pay_for_its_extra_fit(tmp_path, tmp_path_factory):
  from trace_jax import train

  c = _config(tmp_path, tmp_path_factory, method="grpo")
  run = train.build(c)
  assert not run.driver.strategy.reads_predictor
  state = train.init_state(run)
  sample, rec = train.sample_step(run, state)
  fits = []
  run.fitter.fit = lambda *a, **k: fits.append(1)  # would be the extra fit
  state, rec = train.update_step(run, state, sample, rec)
  assert not fits and "predictor_fit_rows" not in rec
  assert np.isfinite(rec["predictor_bce"])  # the joint update still trains the head
