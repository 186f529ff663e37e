"""`RolloutDriver`: every method spends the same budget, in the places its strategy says.

One tiny random Qwen3 sampler engine is shared by all cases (compilation dominates); the stand-in
environment's reward depends on the generated tokens, so trees come out mixed and unmixed.
"""

import collections

import jax
import numpy as np
import pytest
from flax import nnx

from trace_jax.models.qwen3 import Qwen3, get_preset
from trace_jax.rollout.driver import DriverConfig, RolloutDriver
from trace_jax.rollout.sampler import SamplerConfig, SamplerEngine
from trace_jax.rollout.strategies import PREFIX_ALLOCATION, ROOT_ALLOCATION, STRATEGIES
from trace_jax.rollout.testing import IdTokenizer, ScriptedEnv
from trace_jax.rollout.tree import Tree

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


@pytest.fixture
def sampled(engine, request):
  """(method, use_predictor) -> (StepSample, stage-1 root counts), sampled once per module."""
  method, use_pred = request.param
  if (method, use_pred) not in _CACHE:
    driver = RolloutDriver(engine, DriverConfig(method=method, **CFG), predict, prompt_features,
                           seed=0)
    examples = [dict(prompt_ids=p, answers=["x"], id=str(i)) for i, p in enumerate(PROMPTS)]
    s = driver.sample(examples, use_predictor=use_pred)
    engine.release(s.all_trees)
    _CACHE[(method, use_pred)] = s
  return _CACHE[(method, use_pred)]


CASES = [(m, u) for m in STRATEGIES for u in (True, False)
         if u or ROOT_ALLOCATION[m] == "predicted"]
TWO_STAGE = [c for c in CASES if c[0] != "dapo"]


def _root_counts(trees):
  return [len(t.root.children) for t in trees]


def _extra_branches(trees):
  """Continuations forked below the root: children beyond the first at every turn node."""
  return sum(len(n.children) - 1 for t in trees for n in t.nodes[1:] if n.children)


@pytest.mark.parametrize("sampled", TWO_STAGE, indirect=True, ids=str)
def test_equal_budget_and_fork_sites(sampled):
  s, info = sampled, sampled.info
  trees = s.trees
  assert s.all_trees is s.trees or s.all_trees == s.trees
  roots, extra = sum(_root_counts(trees)), _extra_branches(trees)
  assert info["ledger_rollouts_started"] == roots + extra
  assert info["continuations"] == extra
  assert info["ledger_rollouts_started"] == ROOT_BUDGET + PREFIX_BUDGET, (roots, extra, info)
  # Forks happen only at internal turn boundaries: never at leaves, and each fork site is a turn
  # (depth >= 1) that an earlier rollout continued past.
  for t in trees:
    for n in t.nodes[1:]:
      if len(n.children) > 1:
        assert not n.done and n.depth >= 1
    assert len(t.leaves()) == len(t.root.children) + sum(
        len(n.children) - 1 for n in t.nodes[1:] if n.children)
  assert info["stage1_leaves"] == roots
  assert info["ledger_generated_tokens"] == sum(len(n.gen_ids) for t in trees for n in t.nodes)


@pytest.mark.parametrize("sampled", TWO_STAGE, indirect=True, ids=str)
def test_root_counts(sampled, request):
  method, use_pred = request.node.callspec.params["sampled"]
  m = _root_counts(sampled.trees)
  if ROOT_ALLOCATION[method] != "predicted":
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


@pytest.mark.parametrize("sampled", TWO_STAGE, indirect=True, ids=str)
def test_predictions_and_p_hat(sampled, request):
  method, use_pred = request.node.callspec.params["sampled"]
  trees, preds = sampled.trees, sampled.predictions
  predicted_roots = ROOT_ALLOCATION[method] == "predicted"
  predicted_prefixes = PREFIX_ALLOCATION[method].startswith("predicted")
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
    assert by_stage["prefix"] == sampled.info["continuations"]
  else:
    assert by_stage["prefix"] == 0
  # Every candidate anchor of a predicted stage 2 carries its allocation-time p̂; 0.5 without
  # the predictor.
  anchors = [n for t in trees for n in t.nodes[1:]
             if not n.done and n.children and n.rollout < len(t.root.children)]  # stage 1
  if predicted_prefixes:
    assert anchors and all(n.p_hat is not None and 0.0 <= n.p_hat <= 1.0 for n in anchors)
    if not use_pred:
      assert all(n.p_hat == 0.5 for n in anchors)
  else:
    assert all(n.p_hat is None for n in anchors)


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


def test_outcomes_are_mixed_somewhere():
  """The stand-in environment must give both outcomes, or the checks above test little."""
  rewards = {float(n.reward) for s in _CACHE.values() for t in s.all_trees for n in t.leaves()}
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


@pytest.mark.parametrize("method", [m for m in STRATEGIES if PREFIX_ALLOCATION[m] != "none"])
@pytest.mark.parametrize("num_candidates", [3, 5, 14])
def test_stage2_spends_whole_prefix_budget(method, num_candidates):
  """With room for it (candidates x max_per_anchor >= budget), stage 2 spends the whole budget,
  also when the candidates are fewer than the continuations (3 < 6) or the baselines' anchor
  rule does not divide the budget (arpo: round(0.25 x 14) = 4 anchors for 6 continuations)."""
  trees = [_chains(num_candidates)]
  driver = RolloutDriver(None, DriverConfig(method=method, prefix_budget=6, max_per_anchor=4),
                         predict, prompt_features)
  cands = driver._candidates(trees)
  assert len(cands) == num_candidates
  k, _ = driver._prefix_counts(trees, cands, use_predictor=False)
  assert int(np.sum(k)) == 6
  if PREFIX_ALLOCATION[method] in ("predicted", "predicted_tree_aware", "uniform"):
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


def test_pool_rejected_by_uniform_methods(engine):
  driver = RolloutDriver(engine, DriverConfig(method="grpo", prompts_per_step=2, **CFG),
                         predict, prompt_features)
  with pytest.raises(ValueError, match="samples every prompt"):
    driver.sample([dict(prompt_ids=p, answers=["x"]) for p in PROMPTS])


def test_prompt_scoring_is_counted_as_prefill(engine):
  before = engine.ledger.prefill_tokens
  engine.prompt_features(PROMPTS)
  assert engine.ledger.prefill_tokens - before == sum(map(len, PROMPTS))
