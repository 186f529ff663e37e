"""`RolloutDriver`: every method spends the same budget, in the places its strategy says.

One tiny random Qwen3 sampler engine is shared by all cases (compilation dominates); the stand-in
environment's reward depends on the generated tokens, so trees come out mixed and unmixed.
"""

import collections
import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from trace_jax.models.qwen3 import Qwen3, get_preset
from trace_jax.allocation.driver import DriverConfig, RolloutDriver
from trace_jax.sampling.engine import SamplerConfig, SamplerEngine
from trace_jax.allocation import strategies
from trace_jax.allocation.strategies.base import remaining_cost
from trace_jax.allocation.strategies.predicted import anchor_estimates, forced_slots
from trace_jax.sampling.testing import IdTokenizer, ScriptedEnv
from trace_jax.sampling.tree import Tree

V = 64
EOS, SEARCH, ANSWER = 1, 5, 6
TOK = IdTokenizer({SEARCH: "</search>", ANSWER: "</answer>"})
PROMPTS = [[3, 9, 12, 17], [10, 11, 12], [20, 21, 22, 23, 24]]
ROOT_BUDGET, PREFIX_BUDGET = 6, 6
CFG = dict(root_budget=ROOT_BUDGET, prefix_budget=PREFIX_BUDGET, min_per_prompt=1,
           max_per_prompt=3, max_per_anchor=2)
EASY = 5.0  # logit of p̂ for the first prompt: it should get only min_per_prompt rollouts


def predict(feats):
  """Stand-in predictor: a sigmoid of the first feature."""
  return 1.0 / (1.0 + np.exp(-np.asarray(feats, np.float32)[:, 0]))


def prompt_features(prompt_ids):
  """The first prompt looks easy (p̂ ~ 0.99), the others uncertain (p̂ = 0.5)."""
  return np.asarray([[EASY if list(p) == PROMPTS[0] else 0.0, 1.0] for p in prompt_ids],
                    np.float32)


@pytest.fixture(scope="module")
def engine():
  gd, st = nnx.split(Qwen3(get_preset("tiny", vocab_size=V, num_layers=1), rngs=nnx.Rngs(0)))
  st = jax.tree.map(lambda x: x * 4.0, st)  # sharper than the init: more varied turns
  cfg = SamplerConfig(num_slots=4, page_size=4, num_pages=512, max_seq_len=64, max_turn_tokens=4,
                      max_obs_tokens=8, max_turns=4, prefill_chunk=(16,), page_buckets=(16,),
                      max_group_size=2, max_groups=4, seed=1)
  return SamplerEngine(gd, st, cfg, TOK.encode, TOK.decode, ScriptedEnv(V, max_depth=3,
                                                                        obs_growth=1), eos_id=EOS)


_CACHE = {}


def sample_case(engine, case):
  """(method, use_predictor[, stage2]) -> StepSample, sampled once per module."""
  method, use_pred, *mode = case
  stage2 = mode[0] if mode else "batch"
  if case not in _CACHE:
    driver = RolloutDriver(engine, DriverConfig(method=method, stage2=stage2, **CFG), predict,
                           prompt_features, seed=0)
    examples = [dict(prompt_ids=p, answers=["x"], id=str(i), method=method)
                for i, p in enumerate(PROMPTS)]
    s = driver.sample(examples, use_predictor=use_pred)
    engine.release(s.all_trees)
    _CACHE[case] = s
  return _CACHE[case]


@pytest.fixture
def sampled(engine, request):
  return sample_case(engine, request.param)


CASES = [(m, u) for m in strategies.names() for u in (True, False)
         if u or strategies.get(m).reads_predictor]
TWO_STAGE = [c for c in CASES if c[0] != "dapo"]
# Stage 2 streamed into stage 1's tail: every method with a stage 2.
STREAM = [(m, u, "stream") for m, u in TWO_STAGE if strategies.get(m).has_stage2()]


def _root_counts(trees):
  """Stage-1 rollouts per tree (stage 2 may fork more at the root of an unmixed tree)."""
  return [t.meta["stage1_rollouts"] for t in trees]


def _extra_branches(trees):
  """Stage-2 continuations: children beyond the first at every turn node, plus root children
  beyond the stage-1 rollouts."""
  return sum(len(n.children) - 1 for t in trees for n in t.nodes[1:] if n.children) + \
      sum(len(t.root.children) - t.meta["stage1_rollouts"] for t in trees)


@pytest.mark.parametrize("sampled", TWO_STAGE + STREAM, indirect=True, ids=str)
def test_equal_budget_and_fork_sites(sampled):
  s, info = sampled, sampled.info
  trees = s.trees
  assert s.all_trees is s.trees or s.all_trees == s.trees
  roots, extra = sum(_root_counts(trees)), _extra_branches(trees)
  # The measured slice (predicted roots) is sampled outside the budget: the ledger leaves it out.
  assert info["ledger_rollouts_started"] == roots + extra
  assert info["continuations"] == extra
  # Streamed, a group of trees that cannot use its share leaves it unspent (reported); the
  # budget is never exceeded.
  unspent = info.get("stage2_unspent", 0)
  assert 0 <= unspent <= PREFIX_BUDGET
  assert info["ledger_rollouts_started"] == ROOT_BUDGET + PREFIX_BUDGET - unspent, (roots, info)
  # Forks happen only at anchors: never at leaves; a turn that an earlier rollout continued past,
  # or the root of a tree whose stage-1 leaves all agree (predicted strategies only).
  for t in trees:
    for n in t.nodes[1:]:
      if len(n.children) > 1:
        assert not n.done and n.depth >= 1
    assert len(t.leaves()) == len(t.root.children) + sum(
        len(n.children) - 1 for n in t.nodes[1:] if n.children)
    if len(t.root.children) > t.meta["stage1_rollouts"]:
      stage1 = [x.reward for x in t.leaves() if x.rollout < t.meta["stage1_rollouts"]]
      assert len(set(r > 0.5 for r in stage1)) == 1  # only unmixed trees
  assert info["continuations_at_roots"] == sum(len(t.root.children) - t.meta["stage1_rollouts"]
                                               for t in trees)
  assert info["stage1_leaves"] == roots
  assert info["ledger_generated_tokens"] == sum(len(n.gen_ids) for t in trees for n in t.nodes)


@pytest.mark.parametrize("sampled", TWO_STAGE, indirect=True, ids=str)
def test_root_counts(sampled, request):
  method, use_pred = request.node.callspec.params["sampled"]
  m = _root_counts(sampled.trees)
  if not strategies.get(method).reads_predictor:
    want = ROOT_BUDGET + (PREFIX_BUDGET if method == "grpo" else 0)
    assert sum(m) == want and max(m) - min(m) <= 1  # uniform
    assert _extra_branches(sampled.trees) == 0 or method != "grpo"
    return
  assert sum(m) == ROOT_BUDGET
  assert min(m) >= CFG["min_per_prompt"] and max(m) <= CFG["max_per_prompt"]
  if use_pred:  # the prompt predicted easy gets the minimum, the uncertain ones the rest
    assert m[0] == CFG["min_per_prompt"], m
  else:
    assert max(m) - min(m) <= 1, m


@pytest.mark.parametrize("sampled", TWO_STAGE + STREAM, indirect=True, ids=str)
def test_predictions_and_p_hat(sampled, request):
  method, use_pred, *_ = request.node.callspec.params["sampled"]
  trees, preds = sampled.trees, sampled.predictions
  predicted_roots = strategies.get(method).reads_predictor
  predicted_prefixes = method in ("trace", "trace_tree")  # stage 2 reads p̂ at the anchors
  if not use_pred or not predicted_roots:
    assert preds == []
    assert all(t.root.p_hat is None for t in trees)
  for _, p, y in preds:
    assert 0.0 <= p <= 1.0 and y in (0.0, 1.0)
  by_stage = collections.Counter(stage for stage, _, _ in preds)
  if use_pred and predicted_roots:
    assert by_stage["root"] == ROOT_BUDGET  # one per stage-1 leaf
    assert all(0.0 <= t.root.p_hat <= 1.0 for t in trees)
    assert trees[0].root.p_hat > 0.98
  if use_pred and predicted_prefixes:
    assert by_stage["prefix"] + by_stage["root_anchor"] == sampled.info["continuations"]
    assert by_stage["root_anchor"] == sampled.info["continuations_at_roots"]
  else:
    assert by_stage["prefix"] == by_stage["root_anchor"] == 0
  # Every candidate anchor of a predicted stage 2 carries its allocation-time estimate; without
  # the predictor that is the tree's Beta posterior around p̂ = 0.5 (the stage-1 counts move it).
  anchors = [n for t in trees for n in t.nodes[1:]
             if not n.done and n.children and n.rollout < t.meta["stage1_rollouts"]]
  if predicted_prefixes:
    assert anchors and all(n.p_hat is not None and 0.0 <= n.p_hat <= 1.0 for n in anchors)
    if not use_pred:
      for t in trees:
        s1 = [x for x in t.leaves() if x.rollout < t.meta["stage1_rollouts"]]
        post = (0.5 * 4.0 + sum(x.reward for x in s1)) / (4.0 + len(s1))
        for n in t.nodes[1:]:
          if not n.done and n.children and n.rollout < t.meta["stage1_rollouts"]:
            assert n.p_hat == pytest.approx(post, abs=1e-5)
  else:
    assert all(n.p_hat is None for n in anchors)
  # The random slice of the pool: measured (p̂, outcome) pairs outside the budget.
  if use_pred and predicted_roots:
    assert len(sampled.slice_predictions) == len(PROMPTS) * 2  # min(8, pool) prompts x 2
    assert all(st == "slice" and 0.0 <= p <= 1.0 for st, p, _ in sampled.slice_predictions)
    assert sampled.info["slice_n"] == len(PROMPTS) * 2
    assert sampled.info["slice_rollouts_started"] == len(PROMPTS) * 2
    assert sampled.info["slice_generated_tokens"] > 0
  else:
    assert sampled.slice_predictions == [] and "slice_n" not in sampled.info


@pytest.mark.parametrize("sampled", [("dapo", True)], indirect=True, ids=str)
def test_dapo_keeps_mixed_groups_and_charges_dropped(sampled):
  s, info = sampled, sampled.info
  assert all(t.mixed for t in s.trees)
  dropped = [t for t in s.all_trees if not t.mixed]
  assert info["dapo_dropped_groups"] == len(dropped)
  assert info["dapo_dropped_rollouts"] == sum(len(t.leaves()) for t in dropped)
  # The dropped groups were paid for: the ledger counts every rollout sampled.
  total = sum(len(t.leaves()) for t in s.all_trees)
  assert info["ledger_rollouts_started"] == total == ROOT_BUDGET + PREFIX_BUDGET
  assert s.predictions == []


@pytest.mark.parametrize("method", [m for m, u, _ in STREAM if u])
def test_streamed_stage2_equals_batch_when_every_tree_finishes_at_once(engine, method):
  from trace_jax.allocation.stage2 import Stage2Decisions

  driver = RolloutDriver(engine, DriverConfig(method=method, stage2="stream", **CFG), predict,
                         prompt_features, seed=0)
  examples = [dict(prompt_ids=p, answers=["x"], id=str(i)) for i, p in enumerate(PROMPTS)]
  plan = driver.root_plan(examples)
  reqs = driver._root_requests(examples, plan)
  for i, r in enumerate(reqs):
    r.meta = dict(r.meta, stage1_index=i)
  trees = engine.run(reqs)
  try:
    driver.rng = np.random.default_rng(3)
    cands = driver.candidates(trees)
    batch, _ = driver.prefix_counts(trees, cands)
    at_once = Stage2Decisions(driver, True, len(trees))
    driver.rng = np.random.default_rng(3)
    at_once.on_done(list(reversed(trees)))  # any order within one call
    assert at_once.cands == list(cands)
    np.testing.assert_array_equal(at_once.conts, batch)
    assert at_once.shares == [PREFIX_BUDGET] and at_once.left == PREFIX_BUDGET - batch.sum()
    # One tree at a time, in every order: each group gets at most its share of what is left,
    # and the continuations never exceed the budget.
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
      one = Stage2Decisions(driver, True, len(trees))
      for i in order:
        left = one.left
        one.on_done([trees[i]])
        undecided = len(trees) - one.decided + 1
        share = left if one.decided == len(trees) else left // undecided
        assert one.shares[-1] == share
        assert left - one.left <= share
      assert sum(one.conts) <= PREFIX_BUDGET and one.left >= 0
      assert sorted(one.cands) == sorted(cands)  # the same anchors, decided group by group
      assert one.on_done([trees[0]]) == []  # a tree is decided once
    # A deadline of 1/2: once at most half the trees still run (after the second of three), that
    # group spends everything left; the third tree is recorded with zero continuations.
    dl = RolloutDriver(engine, DriverConfig(method=method, stage2="stream",
                                            stage2_deadline=0.5, **CFG), predict,
                       prompt_features, seed=0)
    late = Stage2Decisions(dl, True, len(trees))
    late.on_done([trees[0]])
    forks = late.on_done([trees[1]])
    assert late.closed and late.shares[-1] == PREFIX_BUDGET - sum(
        late.conts[:len(dl.strategy.candidates([trees[0]]))])
    assert sum(f.k for f in forks) <= late.shares[-1]
    n_before = len(late.cands)
    assert late.on_done([trees[2]]) == [] and late.shares[-1] == 0
    assert len(late.cands) > n_before and not any(late.conts[n_before:])
    assert sorted(late.cands) == sorted(cands)
    assert late.left == PREFIX_BUDGET - sum(late.conts) >= 0
    # The closed group's value curve still joins the step's batch price (a deadline must not bias
    # the price later steps decide by).
    assert len(late.gains) == len(one.gains)
    if late.gains:
      assert late.price(PREFIX_BUDGET) == pytest.approx(one.price(PREFIX_BUDGET))
  finally:
    engine.release(trees)


@pytest.mark.parametrize("method", ["trace", "trace_tree"])
def test_value_curve_and_the_price_rule(engine, method):
  from trace_jax.allocation import allocators
  from trace_jax.allocation.stage2 import Stage2Decisions

  driver = RolloutDriver(engine, DriverConfig(method=method, stage2="stream", **CFG), predict,
                         prompt_features, seed=0)
  examples = [dict(prompt_ids=p, answers=["x"], id=str(i)) for i, p in enumerate(PROMPTS)]
  reqs = driver._root_requests(examples, driver.root_plan(examples))
  for i, r in enumerate(reqs):
    r.meta = dict(r.meta, stage1_index=i)
  trees = engine.run(reqs)
  try:
    cands = driver.candidates(trees)
    curve = driver.strategy.value_curve(driver, trees, cands, True, PREFIX_BUDGET)
    assert curve.shape == (PREFIX_BUDGET + 1,) and curve[0] == 0.0
    assert (np.diff(curve) >= -1e-6).all()  # more continuations never lower the objective
    # Its last point is the batch decision's objective.
    batch, p_hat = driver.prefix_counts(trees, cands)
    _, outcomes = anchor_estimates(driver, trees, cands, True)
    valid = np.ones(len(cands), bool)
    if method == "trace":
      want = allocators.prefix_objective(p_hat, outcomes, batch, valid)
    else:
      want = allocators.tree_aware_objective(
          p_hat, outcomes, batch, np.asarray([ti for ti, _ in cands]),
          np.asarray([t.mixed for t in trees]), valid, driver.cfg.tree_lambda)
    assert curve[-1] == pytest.approx(float(want), abs=1e-5)
    # With a price, a group (not the last) takes the units its curve values at least that much,
    # at most max_share fair shares.
    own = driver.strategy.value_curve(driver, trees[:1], driver.strategy.candidates(trees[:1]),
                                      True, PREFIX_BUDGET)
    gains = np.diff(own)
    for price in (0.0, float(np.median(gains)), float(gains.max()) + 1.0):
      driver._stage2_prices = [price]
      one = Stage2Decisions(driver, True, len(trees))
      one.on_done([trees[0]])
      below = np.flatnonzero(gains < price)
      worth = int(below[0]) if below.size else PREFIX_BUDGET
      cap = int(np.ceil(Stage2Decisions.max_share * PREFIX_BUDGET / len(trees)))
      assert one.shares == [min(worth, cap)], (price, gains)
    assert one.price(PREFIX_BUDGET) == pytest.approx(
        float(np.sort(gains)[::-1][PREFIX_BUDGET - 1]))
    driver._stage2_prices = [1.0, 2.0, 3.0]
    assert driver.stage2_price() == 2.0
    restored = RolloutDriver(engine, driver.cfg, predict, prompt_features)
    restored.load_state_dict(driver.state_dict())
    assert restored.stage2_price() == 2.0
  finally:
    engine.release(trees)


def test_outcomes_are_mixed_somewhere(engine):
  """The stand-in environment must give both outcomes, or the checks above test little."""
  samples = [sample_case(engine, c) for c in CASES]  # those the checks above read (cached)
  rewards = {float(n.reward) for s in samples for t in s.all_trees for n in t.leaves()}
  assert {0.0, 1.0} <= rewards


def test_unknown_method_raises(engine):
  with pytest.raises(ValueError, match="unknown strategy"):
    RolloutDriver(engine, DriverConfig(method="nope"), predict, prompt_features)


# ---- stage 2 budget on hand-built stage-1 trees (no engine) --------------------------------------
def _chains(n, depth=2):
  """One tree of `n` two-turn rollouts from the root: n internal turn boundaries."""
  t = Tree([1, 2])
  for c in range(n):
    parent = 0
    for d in range(depth):
      last = d == depth - 1
      parent = t.add_node(parent, gen_ids=[5, 6], obs_ids=[] if last else [7],
                          entropies=[0.1 * (c + d), 0.0], done=last,
                          reward=float(c % 2) if last else None).id
  return t


@pytest.mark.parametrize("method", [m for m in strategies.names()
                                    if strategies.get(m).has_stage2()])
@pytest.mark.parametrize("num_candidates", [3, 5, 14])
def test_stage2_spends_whole_prefix_budget(method, num_candidates):
  """With room for it (candidates x max_per_anchor >= budget), stage 2 spends the whole budget,
  also when the candidates are fewer than the continuations (3 < 6) or the baselines' anchor
  rule does not divide the budget (arpo: round(0.25 x 14) = 4 anchors for 6 continuations)."""
  trees = [_chains(num_candidates)]
  driver = RolloutDriver(None, DriverConfig(method=method, prefix_budget=6, max_per_anchor=4),
                         predict, prompt_features)
  cands = driver.candidates(trees)
  assert len(cands) == num_candidates
  k, _ = driver.prefix_counts(trees, cands, use_predictor=False)
  assert int(np.sum(k)) == 6
  if method in ("trace", "trace_tree", "root_only"):
    assert np.all(np.asarray(k) <= 4)  # max_per_anchor (the baselines branch by their own rule)


def test_dapo_spends_whole_budget_when_uneven(engine):
  """10 rollouts over 3 prompts: groups of 4, 3 and 3, nothing left unspent."""
  driver = RolloutDriver(engine, DriverConfig(method="dapo", **dict(CFG, prefix_budget=4)),
                         predict, prompt_features)
  s = driver.sample([dict(prompt_ids=p, answers=["x"]) for p in PROMPTS])
  engine.release(s.all_trees)
  assert s.info["ledger_rollouts_started"] == ROOT_BUDGET + 4
  assert sorted(len(t.root.children) for t in s.all_trees) == [3, 3, 4]


@pytest.mark.parametrize("use_pred", [True, False])
def test_candidate_pool_selects_prompts(engine, use_pred):
  """Scoring 3 candidates for 2 places: the prompt predicted easy is left out (uniform over the
  first two without the predictor), and the root budget still goes out in full."""
  driver = RolloutDriver(engine, DriverConfig(method="trace_tree", prompts_per_step=2, **CFG),
                         predict, prompt_features)
  examples = [dict(prompt_ids=p, answers=["x"], id=str(i)) for i, p in enumerate(PROMPTS)]
  s = driver.sample(examples, use_predictor=use_pred)
  engine.release(s.all_trees)
  ids = [t.meta["id"] for t in s.trees]
  assert ids == (["1", "2"] if use_pred else ["0", "1"])
  assert s.info["prompts_sampled"] == 2 and s.info["prompts_scored"] == 3
  assert s.info["stage1_leaves"] == ROOT_BUDGET
  assert s.info["ledger_rollouts_started"] == ROOT_BUDGET + PREFIX_BUDGET


def test_explore_slots_take_random_pool_prompts(engine):
  """With every place an exploration slot, the step's prompts are exactly the randomly drawn ones,
  so the prompt the head calls easy (never chosen by p̂ alone) is sampled under some seeds, with
  its real p̂ on its tree; with one slot of two, the other place still goes by p̂."""
  examples = [dict(prompt_ids=p, answers=["x"], id=str(i)) for i, p in enumerate(PROMPTS)]
  easy = float(predict(np.array([[EASY]]))[0])
  chosen = []
  for seed in range(4):
    driver = RolloutDriver(engine, DriverConfig(method="trace_tree", prompts_per_step=2,
                                                explore_prompts=2, **CFG),
                           predict, prompt_features, seed=seed)
    s = driver.sample(examples, use_predictor=True)
    engine.release(s.all_trees)
    ids = sorted(t.meta["id"] for t in s.trees)
    assert all(t.meta["explored"] for t in s.trees)  # every tree came from a random slot
    chosen.append(ids)
    if "0" in ids:
      assert [t.root.p_hat for t in s.trees if t.meta["id"] == "0"] == [pytest.approx(easy)]
      assert s.info["pool_p_hat_explored"] > 0.5
  assert any("0" in ids for ids in chosen) and any("0" not in ids for ids in chosen)
  driver = RolloutDriver(engine, DriverConfig(method="trace_tree", prompts_per_step=2,
                                              explore_prompts=1, **CFG),
                         predict, prompt_features, seed=0)
  s = driver.sample(examples, use_predictor=True)
  engine.release(s.all_trees)
  ids = {t.meta["id"] for t in s.trees}
  explored = [t.meta["id"] for t in s.trees if t.meta["explored"]]
  assert len(ids) == 2 and len(explored) == 1
  assert ids - set(explored) <= {"1", "2"}  # the p̂ place skips the easy one


def test_hard_slots_take_the_lowest_p_hat_prompts(engine):
  """`hard_prompts`: the pool's lowest-p̂ prompts are taken whatever stage 1's mixed-group value
  says of them, keep their real p̂, and are marked on their trees; with exploration slots as well,
  the random ones are drawn from the rest of the pool."""
  hard_logit = -5.0  # prompt 2 looks hopeless (p̂ ~ 0.007), prompt 0 easy, prompt 1 uncertain

  def features(prompt_ids):
    logit = {0: EASY, 2: hard_logit}
    return np.asarray([[logit.get(PROMPTS.index(list(p)), 0.0), 1.0] for p in prompt_ids],
                      np.float32)

  examples = [dict(prompt_ids=p, answers=["x"], id=str(i)) for i, p in enumerate(PROMPTS)]
  hard_p = float(predict(np.array([[hard_logit]]))[0])
  for hard, expect in ((0, None), (1, {"1", "2"})):
    driver = RolloutDriver(engine, DriverConfig(method="trace_tree", prompts_per_step=2,
                                                hard_prompts=hard, **CFG),
                           predict, features, seed=0)
    s = driver.sample(examples, use_predictor=True)
    engine.release(s.all_trees)
    ids = {t.meta["id"] for t in s.trees}
    if expect is None:  # on p̂ alone the easy prompt (0.99) beats the hopeless one (0.007)
      assert "1" in ids and "2" not in ids and "pool_p_hat_hard" not in s.info
      assert all("hard" not in t.meta for t in s.trees)
      continue
    assert ids == expect
    assert {t.meta["id"]: t.meta["hard"] for t in s.trees} == {"1": False, "2": True}
    assert [t.root.p_hat for t in s.trees if t.meta["id"] == "2"] == [pytest.approx(hard_p)]
    assert s.info["pool_p_hat_hard"] == pytest.approx(hard_p)
  driver = RolloutDriver(engine, DriverConfig(method="trace_tree", prompts_per_step=4,
                                              hard_prompts=2, explore_prompts=2, **CFG),
                         predict, features, seed=3)
  p_hat = np.array([0.9, 0.02, 0.5, 0.01, 0.7, 0.3], np.float32)
  for _ in range(5):
    seen, slots = forced_slots(p_hat, 4, driver.cfg.hard_prompts, driver.cfg.explore_prompts,
                               driver.rng)
    assert slots["hard"].tolist() == [1, 3]
    assert len(slots["explored"]) == 2 and not set(slots["explored"]) & {1, 3}
    forced = np.concatenate([slots["hard"], slots["explored"]])
    assert np.all(seen[forced] == 0.5)
    rest = np.setdiff1d(np.arange(6), forced)
    np.testing.assert_array_equal(seen[rest], p_hat[rest])


def test_hard_slots_apply_when_every_prompt_is_taken(engine):
  """With no larger pool (every prompt given rollouts), a hard slot still reads its prompt as
  p̂ = 0.5 for the counts: the hopeless prompt gets the uncertain prompt's share, not the
  minimum."""
  def features(prompt_ids):
    logit = {0: EASY, 2: -5.0}
    return np.asarray([[logit.get(PROMPTS.index(list(p)), 0.0), 1.0] for p in prompt_ids],
                      np.float32)

  examples = [dict(prompt_ids=p, answers=["x"], id=str(i)) for i, p in enumerate(PROMPTS)]
  counts = {}
  for hard in (0, 1):
    cfg = DriverConfig(method="trace_tree", hard_prompts=hard, **dict(CFG, max_per_prompt=6))
    driver = RolloutDriver(engine, cfg, predict, features, seed=0)
    plan = driver.root_plan(examples, use_predictor=True)
    m, p_hat, slots = plan.counts, plan.p_hat, plan.slots
    assert m.sum() == ROOT_BUDGET and p_hat[2] < 0.01
    assert slots["hard"].tolist() == ([2] if hard else [])
    counts[hard] = m.tolist()
  assert counts[0][2] < counts[0][1] - 1, counts  # on p̂ alone the hopeless prompt gets less
  # with the slot, as much as the uncertain one (the odd rollout goes to one of the two)
  assert counts[1][2] > counts[0][2] and abs(counts[1][2] - counts[1][1]) <= 1, counts


def test_pool_rejected_by_uniform_methods(engine):
  driver = RolloutDriver(engine, DriverConfig(method="grpo", prompts_per_step=2, **CFG),
                         predict, prompt_features)
  with pytest.raises(ValueError, match="samples every prompt"):
    driver.sample([dict(prompt_ids=p, answers=["x"]) for p in PROMPTS])


def test_prompt_scoring_is_counted_as_prefill(engine):
  before = engine.ledger.prefill_tokens
  engine.prompt_features(PROMPTS)
  assert engine.ledger.prefill_tokens - before == sum(map(len, PROMPTS))


def test_root_continuations_happen_somewhere(engine):
  """The engine runs above must include forks at the root of an unmixed tree (trace or
  trace_tree), or the root-anchor checks in test_equal_budget_and_fork_sites test little."""
  samples = {c: sample_case(engine, c) for c in CASES}  # those the checks read (cached)
  assert any(s.info.get("continuations_at_roots", 0) > 0 for s in samples.values()), \
      {k: s.info.get("continuations_at_roots") for k, s in samples.items()}


# ---- stage 2 details on hand-built trees (no engine) ---------------------------------------------
def _logit(p):
  return float(np.log(p) - np.log1p(-p))


def _chain(t, gens, reward, p_hats=None, rollout=-1, entropies=None):
  """One rollout from the root with turns generating gens[i] tokens; features make the stand-in
  predictor say p_hats[i] at the i-th turn boundary."""
  parent = 0
  for d, g in enumerate(gens):
    last = d == len(gens) - 1
    f = None if p_hats is None or last else np.asarray([_logit(p_hats[d]), 1.0], np.float32)
    ent = [entropies[d], 0.0] if entropies is not None else []
    parent = t.add_node(parent, gen_ids=[5] * g, obs_ids=[] if last else [7], feature=f,
                        done=last, reward=reward if last else None, rollout=rollout,
                        entropies=ent).id
  return t


def test_remaining_cost_averages_over_rollouts_that_pass_the_depth():
  """A rollout that ends at depth 1 is no continuation from depth 1: the depth-1 cost is the mean
  over the rollouts that go on (7), not (7 + 0) / 2; depth 0 is a whole rollout."""
  t = Tree([1, 2])
  _chain(t, [2, 3, 4], 0.0)
  _chain(t, [5], 1.0)
  cost = remaining_cost([t])
  assert cost == {0: pytest.approx(7.0), 1: pytest.approx(7.0), 2: pytest.approx(4.0)}


def _two_anchor_tree():
  """One failed rollout: turn 1 (2 tokens), turn 2 (25 tokens), answer (5 tokens). The anchor
  after turn 1 looks even (p̂ 0.5, 30 tokens to go), the one after turn 2 poor (p̂ 0.2, 5 to go)."""
  t = Tree([1, 2])
  t.root.feature = np.asarray([0.0, 1.0], np.float32)
  return _chain(t, [2, 25, 5], 0.0, p_hats=[0.5, 0.2])


@pytest.mark.parametrize("unit,want", [("rollouts", [1, 0]), ("tokens", [0, 1])])
def test_ranking_per_rollout_or_per_token(unit, want):
  """Under a rollout budget every continuation costs one rollout: the larger gain wins (q = 0.5
  beats q = 0.8). Under a token budget (32 tokens, one fresh rollout's worth) gain per expected
  token wins: 0.2 / 5 beats 0.5 / 30, and the 30-token anchor no longer fits."""
  trees = [_two_anchor_tree()]
  cfg = DriverConfig(method="trace", prefix_budget=1, max_per_anchor=1, budget_unit=unit,
                     anchor_posterior=False, root_anchors=False)
  driver = RolloutDriver(None, cfg, predict, prompt_features)
  cands = driver.candidates(trees)
  assert [nid for _, nid in cands] == [1, 2]
  k, p = driver.prefix_counts(trees, cands, use_predictor=True)
  np.testing.assert_allclose(p, [0.5, 0.2], atol=1e-5)
  assert k.tolist() == want
  # cost_aware=False ranks by gain alone also under a token budget.
  driver = RolloutDriver(None, dataclasses.replace(cfg, cost_aware=False), predict,
                         prompt_features)
  assert driver.prefix_counts(trees, cands, use_predictor=True)[0].tolist() == [1, 0]


def test_root_is_an_anchor_of_unmixed_trees_only():
  """Every stage-1 rollout of tree 0 failed after turn boundaries that look hopeless (p̂ 0.02);
  its prompt looks even (p̂ 0.5): the fresh draw at the root is the best continuation. A mixed
  tree's root is no candidate, nor are roots for the baselines."""
  t0 = Tree([1, 2])
  t0.root.feature = np.asarray([0.0, 1.0], np.float32)
  for r in range(2):
    _chain(t0, [3, 3], 0.0, p_hats=[0.02], rollout=r)
  t1 = Tree([3, 4])
  t1.root.feature = np.asarray([0.0, 1.0], np.float32)
  _chain(t1, [3, 3], 0.0, p_hats=[0.4], rollout=0)
  _chain(t1, [3, 3], 1.0, p_hats=[0.6], rollout=1)
  trees = [t0, t1]
  cfg = DriverConfig(method="trace_tree", prefix_budget=1, max_per_anchor=1,
                     anchor_posterior=False)
  driver = RolloutDriver(None, cfg, predict, prompt_features)
  cands = driver.candidates(trees)
  assert (0, 0) in cands and (1, 0) not in cands
  k, _ = driver.prefix_counts(trees, cands, use_predictor=True)
  assert k[cands.index((0, 0))] == 1 and k.sum() == 1
  for method in ("root_only", "tree_grpo", "arpo"):
    d = RolloutDriver(None, dataclasses.replace(cfg, method=method), predict, prompt_features)
    assert all(nid != 0 for _, nid in d.candidates(trees))
  d = RolloutDriver(None, dataclasses.replace(cfg, root_anchors=False), predict, prompt_features)
  assert all(nid != 0 for _, nid in d.candidates(trees))


def test_anchor_estimates_use_the_trees_own_outcomes():
  """Four failed stage-1 rollouts of a prompt the head rates 0.5: the Beta posterior (s = 4) says
  (2 + 0) / 8 = 0.25 for the prompt, and an anchor the head rates one logit above its prompt
  moves one logit above 0.25."""
  t = Tree([1, 2])
  t.root.feature = np.asarray([0.0, 1.0], np.float32)
  for r in range(4):
    _chain(t, [3, 3], 0.0, p_hats=[1 / (1 + np.exp(-1.0))], rollout=r)
  driver = RolloutDriver(None, DriverConfig(method="trace"), predict, prompt_features)
  cands = driver.candidates([t])
  p, _ = anchor_estimates(driver, [t], cands, use_predictor=True)
  want_anchor = 1 / (1 + np.exp(-(_logit(0.25) + 1.0)))
  np.testing.assert_allclose(p, [0.25] + [want_anchor] * 4, atol=1e-5)
  off = RolloutDriver(None, DriverConfig(method="trace", anchor_posterior=False), predict,
                      prompt_features)
  np.testing.assert_allclose(anchor_estimates(off, [t], cands, use_predictor=True)[0],
                             [0.5] + [1 / (1 + np.exp(-1.0))] * 4, atol=1e-5)


def test_tokens_budget_buys_more_short_continuations_for_baselines():
  """Under budget_unit="tokens" the baselines' rules get the continuations that the tokens of
  prefix_budget fresh rollouts buy at their candidates' mean cost: 4 x 12 / 6 = 8 here."""
  trees = [_chains(5, depth=2)]
  for n in trees[0].nodes[1:]:  # two turns of 6 tokens: 12 per rollout, 6 from an anchor
    n.gen_ids = [5] * 6
  for method in ("root_only", "tree_grpo", "arpo"):
    cfg = DriverConfig(method=method, prefix_budget=4, max_per_anchor=4, budget_unit="tokens")
    d = RolloutDriver(None, cfg, predict, prompt_features)
    k, _ = d.prefix_counts(trees, d.candidates(trees), use_predictor=False)
    assert int(np.sum(k)) == 8, method


def test_arpo_branches_by_entropy_rise_and_respects_the_cap():
  """Delta H = entropy after the tool result minus the rollout's initial entropy. Chain c's
  anchor has Delta H = c (initial entropy 10 - c, then 10); the top quarter of 8 anchors (2) branch
  first, at most max_per_anchor = 2 each; the 6-continuation budget then reaches anchor 5."""
  t = Tree([1, 2])
  for c in range(8):
    _chain(t, [2, 2], float(c % 2), rollout=c, entropies=[10.0 - c, 10.0])
  cfg = DriverConfig(method="arpo", prefix_budget=6, max_per_anchor=2, arpo_entropy_top=0.25)
  d = RolloutDriver(None, cfg, predict, prompt_features)
  cands = d.candidates([t])
  k = d.prefix_counts([t], cands, use_predictor=False)[0]
  by_chain = [int(k[j]) for j in range(8)]
  assert by_chain == [0, 0, 0, 0, 0, 2, 2, 2], by_chain


def test_tree_grpo_expands_every_tree():
  """Tree-GRPO expands nodes of every tree: a tree with one anchor gets half of the budget even
  next to a tree with ten."""
  small, big = _chains(1), _chains(10)
  cfg = DriverConfig(method="tree_grpo", prefix_budget=4, max_per_anchor=4)
  d = RolloutDriver(None, cfg, predict, prompt_features, seed=3)
  trees = [small, big]
  cands = d.candidates(trees)
  k = d.prefix_counts(trees, cands, use_predictor=False)[0]
  per_tree = [sum(int(kk) for (ti, _), kk in zip(cands, k) if ti == i) for i in range(2)]
  assert per_tree == [2, 2]
  assert max(int(kk) for (ti, _), kk in zip(cands, k) if ti == 1) == 1  # distinct anchors first


def test_platt_calibration_from_the_slice_changes_the_selection(engine):
  """The slice says p̂ = 0.99 prompts succeed half the time and p̂ = 0.5 prompts never: after
  calibration the prompt predicted easy is the most likely to be mixed, and is selected."""
  driver = RolloutDriver(engine, DriverConfig(method="trace_tree", prompts_per_step=2,
                                              calibrate="platt", calibrate_prior=1.0, **CFG),
                         predict, prompt_features)
  easy = float(predict(np.array([[EASY]]))[0])
  driver._slice_log = [[("slice", easy, float(i % 2)) for i in range(20)]
                       + [("slice", 0.5, 0.0) for _ in range(20)]]
  examples = [dict(prompt_ids=p, answers=["x"], id=str(i)) for i, p in enumerate(PROMPTS)]
  s = driver.sample(examples, use_predictor=True)
  engine.release(s.all_trees)
  assert "0" in [t.meta["id"] for t in s.trees]
  assert s.info["calib_a"] < 0.5 and s.info["calib_b"] < -1.0
  # The slice keeps recording raw p̂ (what the next fit needs), not the calibrated one.
  assert {round(x[1], 3) for x in driver._slice_log[-1]} <= {round(easy, 3), 0.5}


@pytest.mark.parametrize("sampled", STREAM, indirect=True, ids=str)
def test_streamed_steps_decided_group_by_group(sampled):
  """The stream cases ran streamed; the trees finished apart, so stage 2 was decided in more than
  one group (the test engine's three trees end at different decode steps)."""
  assert sampled.info["stage2_streamed"] == 1.0
  assert 1 < sampled.info["stage2_decisions"] <= len(PROMPTS), sampled.info["stage2_decisions"]


def test_binned_root_objective_reads_past_outcomes_not_p_hat(engine):
  """root_objective="binned": the stage-1 trees logged so far, binned by p̂, give each bin's
  Beta. Prompts at p̂ = 0.5 whose past peers always or never succeeded lose the budget to
  prompts at p̂ = 0.88 whose peers mixed; before any log, the paper objective decides."""
  logits = [0.0, 2.0, 0.0, 2.0, 0.0, 2.0]
  prompts = [[30 + i, 40 + i] for i in range(6)]
  examples = [dict(prompt_ids=p, answers=["x"], id=str(i)) for i, p in enumerate(prompts)]

  def features(prompt_ids):
    return np.asarray([[logits[prompts.index(list(p))], 1.0] for p in prompt_ids], np.float32)

  cfg = DriverConfig(method="trace_tree", root_budget=9, prefix_budget=0, min_per_prompt=2,
                     max_per_prompt=5, prompts_per_step=3, candidate_prompts=6,
                     root_objective="binned", binned_bins=2, binned_window=4)
  driver = RolloutDriver(None, cfg, predict, features, seed=0)
  plan = driver.root_plan(examples, use_predictor=True)
  assert np.flatnonzero(plan.counts).tolist() == [0, 2, 4] and plan.beta_mean is None
  p_lo, p_hi = float(predict(np.zeros((1, 2)))[0]), float(predict(np.full((1, 2), 2.0))[0])
  driver._root_log = [[(p_lo, k, 4) for k in (0, 4) * 4] + [(p_hi, 2, 4)] * 8]
  plan = driver.root_plan(examples, use_predictor=True)
  assert np.flatnonzero(plan.counts).tolist() == [1, 3, 5], plan.counts
  assert plan.counts.sum() == 9 and plan.concentration[0] < 0.1 < plan.concentration[1]
  assert plan.beta_mean[:2] == pytest.approx([0.5, 0.5], abs=0.03)
  # A hard slot is still taken whatever the table says.
  hard = RolloutDriver(None, dataclasses.replace(cfg, hard_prompts=1), predict, features, seed=0)
  hard._root_log = driver._root_log
  assert (hard.root_plan(examples, use_predictor=True).counts[0]) > 0
  # The log travels with the driver's state (a resumed run allocates the same).
  restored = RolloutDriver(None, cfg, predict, features, seed=0)
  restored.load_state_dict(driver.state_dict())
  np.testing.assert_array_equal(restored.root_plan(examples, True).counts, plan.counts)


def test_binned_root_objective_logs_stage_one_trees(engine):
  cfg = DriverConfig(method="trace_tree", root_objective="binned", binned_window=2, **CFG)
  driver = RolloutDriver(engine, cfg, predict, prompt_features, seed=0)
  examples = [dict(prompt_ids=p, answers=["x"], id=str(i)) for i, p in enumerate(PROMPTS)]
  for step in range(3):
    s = driver.sample(examples, use_predictor=True)
    logged = driver._root_log[-1]
    stage1 = sorted(int(t.meta["stage1_rollouts"]) for t in s.all_trees)
    assert sorted(m for _, _, m in logged) == stage1 and sum(stage1) == ROOT_BUDGET
    assert all(0 <= k <= m for _, k, m in logged)
    assert sorted(p for p, _, _ in logged) == pytest.approx(sorted(t.root.p_hat
                                                                   for t in s.all_trees))
    engine.release(s.all_trees)
  assert len(driver._root_log) == 2  # the window


@pytest.mark.parametrize("prefix_budget", [0, PREFIX_BUDGET])
def test_rollouts_ahead_with_a_measured_slice_and_any_prefix_budget(engine, prefix_budget):
  """Rollouts one step ahead start in the step's last engine run: the measured slice's when
  stage 2 has no budget (they used to start in stage 1 and the slice's run then refused them:
  "trees started ahead by the last run are still live")."""
  cfg = DriverConfig(method="trace_tree", metric_slice=2, metric_rollouts=1,
                     **dict(CFG, prefix_budget=prefix_budget))
  driver = RolloutDriver(engine, cfg, predict, prompt_features, seed=0)
  examples = [dict(prompt_ids=p, answers=["x"], id=str(i)) for i, p in enumerate(PROMPTS)]
  ahead = [dict(e, id=f"next-{e['id']}") for e in examples]
  first = driver.sample(examples, use_predictor=True, ahead_examples=ahead)
  assert first.info["slice_n"] > 0 and len(engine.carried) > 0
  second = driver.sample(ahead, use_predictor=True)  # adopts them
  assert not engine.carried and len(second.trees) == len(examples)
  assert all(t.meta["id"].startswith("next-") for t in second.trees)
  for s in (first, second):
    engine.release(s.all_trees + s.slice_trees)
