"""Selection bias: the behaviour log-probs the sampler records under top-k / top-p, and the
predictor targets of anchors stage 2 forked (`rollout_values`)."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trace_jax.allocation.prefix_allocators import repeat_prob
from trace_jax.models.qwen3 import Qwen3, get_preset
from trace_jax.sampling.engine import PromptRequest, SamplerConfig, SamplerEngine
from trace_jax.sampling.engine_ops import sample_tokens
from trace_jax.sampling.testing import IdTokenizer, ScriptedEnv, make_forward
from trace_jax.sampling.tree import Tree, rollout_values

V = 64
EOS, SEARCH, ANSWER = 1, 5, 6
TOK = IdTokenizer({SEARCH: "</search>", ANSWER: "</answer>"})
PROMPTS = [[3, 9, 12, 17, 22, 30, 41], [10, 11, 12], list(range(20, 38))]


def filtered_logprob(logits, tok, temperature, top_p, top_k, cap=0):
  """log mu(tok) of softmax(logits / T) kept by top-k / top-p and renormalized, in float64,
  and whether tok is kept. cap > 0: first only the cap best tokens, renormalized (the sampler's
  static `max_top_k`)."""
  z = np.asarray(logits, np.float64) / temperature
  p = np.exp(z - z.max())
  if cap:
    p[np.argsort(-p, kind="stable")[cap:]] = 0.0
  p /= p.sum()
  order = np.argsort(-p, kind="stable")
  ps = p[order]
  rank = np.arange(len(p))
  keep = (rank < (top_k if top_k > 0 else len(p))) & (np.cumsum(ps) - ps < top_p)
  kept = order[keep]
  return math.log(p[tok] / p[kept].sum()), bool(np.isin(tok, kept))


# ---- behaviour log-probs -------------------------------------------------------------------------
def test_sample_tokens_records_the_filtered_renormalized_logprob():
  s, vocab = 64, 16
  logits = jax.random.normal(jax.random.key(1), (s, vocab)) * 2
  keys = np.tile(np.asarray([[3, 5]], np.uint32), (s, 1))
  cnt = np.arange(s, dtype=np.int32)
  no = jnp.zeros(s, bool)
  for t, p, k, cap in [(1.0, 1.0, 2, 0), (0.7, 0.5, 0, 0), (1.3, 0.6, 3, 0), (1.0, 1.0, 2, 5),
                       (0.8, 0.7, 0, 5)]:
    tok, lp, _ = sample_tokens(logits, keys, cnt, jnp.full(s, t), jnp.full(s, p),
                               jnp.full(s, k, jnp.int32), no, max_top_k=cap)
    for i in range(s):
      want, kept = filtered_logprob(logits[i], int(tok[i]), t, p, k, cap)
      assert kept, (t, p, k, cap, i)
      assert float(lp[i]) == pytest.approx(want, abs=1e-5), (t, p, k, cap, i)
    plain = jax.nn.log_softmax(logits / t)[np.arange(s), tok]
    assert float(jnp.max(plain - lp)) < -1e-3  # the filter's mass < 1: not the unfiltered value
  # Filters off (top_p = 1, top_k = 0): exactly the tempered log-softmax, bit for bit, with and
  # without the sorting path compiled in; greedy rows keep the untempered, unfiltered value.
  for nucleus in (False, True):
    tok, lp, ent = sample_tokens(logits, keys, cnt, jnp.full(s, 0.7), jnp.ones(s),
                                 jnp.zeros(s, jnp.int32), no, nucleus=nucleus)
    logp = jax.nn.log_softmax(logits / 0.7)
    np.testing.assert_array_equal(lp, logp[np.arange(s), tok])
    np.testing.assert_array_equal(ent, -jnp.sum(jnp.exp(logp) * logp, -1))
  g = jnp.arange(s) % 2 == 0
  tok, lp, _ = sample_tokens(logits, keys, cnt, jnp.full(s, 0.7), jnp.full(s, 0.5),
                             jnp.full(s, 2, jnp.int32), g)
  best = jnp.argmax(logits, -1)
  np.testing.assert_array_equal(np.asarray(tok)[::2], np.asarray(best)[::2])
  np.testing.assert_array_equal(np.asarray(lp)[::2],
                                np.asarray(jax.nn.log_softmax(logits)[np.arange(s), best])[::2])


@pytest.fixture(scope="module")
def model():
  gd, st = nnx.split(Qwen3(get_preset("tiny", vocab_size=V), rngs=nnx.Rngs(0)))
  return gd, jax.tree.map(lambda x: x * 6.0, st)  # as in test_sampler: inputs matter


def sampled_trees(model, **kw):
  cfg = dict(num_slots=4, page_size=4, num_pages=256, max_seq_len=80, max_turn_tokens=6,
             max_obs_tokens=12, max_turns=3, prefill_chunk=(16,), page_buckets=(24,),
             greedy=False, max_group_size=2, max_groups=2, seed=3)
  cfg.update(kw)
  engine = SamplerEngine(model[0], model[1], SamplerConfig(**cfg), TOK.encode, TOK.decode,
                         ScriptedEnv(V), eos_id=EOS)
  return engine.run([PromptRequest(p, n=2) for p in PROMPTS])


@pytest.mark.parametrize("filters", [dict(top_k=2), dict(top_p=0.5), dict()])
def test_engine_records_the_behaviour_logprob_of_each_token(model, filters):
  """Every generated token's recorded log-prob, replayed through a plain forward: the log of its
  renormalized probability under the filter it was drawn with; with no filter, the tempered
  log-softmax (what the update recomputes)."""
  temperature = 1.3
  trees = sampled_trees(model, temperature=temperature, **filters)
  fwd = make_forward(model[0])
  top_p, top_k = filters.get("top_p", 1.0), filters.get("top_k", 0)
  gaps, n = [], 0
  for tree in trees:
    for leaf in tree.leaves():
      ids, mask, _, lps = tree.path_tokens(leaf.id)
      logits, _ = jax.device_get(fwd(model[1], jnp.asarray(ids)[None]))
      plain = jax.nn.log_softmax(logits / temperature, axis=-1)
      for t in np.nonzero(mask)[0]:
        want, kept = filtered_logprob(logits[t - 1], ids[t], temperature, top_p, top_k)
        assert kept, (tree.uid, leaf.id, t)
        assert lps[t] == pytest.approx(want, abs=2e-4), (filters, tree.uid, leaf.id, t)
        gaps.append(float(plain[t - 1, ids[t]]) - want)
        n += 1
  assert n > 30
  if filters:  # the filtered value differs from the unfiltered one the old record held
    assert max(gaps) < 0 and np.mean(gaps) < -0.05, np.mean(gaps)
  else:
    assert max(map(abs, gaps)) < 2e-4


# ---- predictor targets of forked anchors ---------------------------------------------------------
def forked_tree(r, continuations):
  """Stage 1: one rollout root -> a -> leaf (reward r); stage 2: continuations from a."""
  t = Tree([1, 2], uid=0)
  a = t.add_node(0, gen_ids=[5], obs_ids=[6], rollout=0)
  t.add_node(a.id, gen_ids=[7], done=True, reward=float(r), rollout=0)
  for i, c in enumerate(continuations):
    t.add_node(a.id, gen_ids=[9], done=True, reward=float(c), rollout=1 + i)
  t.meta["stage1_rollouts"] = 1
  return t, a.id


def test_forked_anchor_target_is_its_stage1_outcome_alone():
  """Stage 1 leaf r = 0 picked anchor a, three continuations (all 1) follow: a's target is r alone,
  not the pooled 0.25 * (0 + 1 + 1 + 1) = 0.75; each continuation counts for its own node; the
  root keeps stage 1's rollout; per_leaf gives the pooled values."""
  t, a = forked_tree(0, [1, 1, 1])
  values, counts = rollout_values(t)
  assert values[a] == 0.0 and counts[a] == 1
  assert values[0] == 0.0 and counts[0] == 1
  assert values[3:] == [1.0] * 3 and counts[3:] == [1] * 3
  pooled, n = rollout_values(t, per_leaf=True)
  assert pooled[a] == pytest.approx(0.75) and n[a] == 4 and pooled[0] == 0.0


def test_fresh_root_draws_do_not_count_for_the_root():
  """Stage 2's fresh draws at the root of an unmixed tree (serials >= stage1_rollouts) count for
  their own nodes only; the root's target stays the stage-1 mean."""
  t = Tree([1, 2], uid=0)
  for i, r in enumerate([0.0, 0.0, 1.0, 1.0]):
    x = t.add_node(0, gen_ids=[5], obs_ids=[6], rollout=i)
    t.add_node(x.id, gen_ids=[7], done=True, reward=r, rollout=i)
  t.meta["stage1_rollouts"] = 2
  values, counts = rollout_values(t)
  assert values[0] == 0.0 and counts[0] == 2
  assert values[5] == 1.0 and counts[5] == 1 and values[6] == 1.0
  assert rollout_values(t, per_leaf=True) == ([0.5, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0],
                                              [4, 1, 1, 1, 1, 1, 1, 1, 1])
  del t.meta["stage1_rollouts"]  # a tree that does not record stage 1: every root rollout counts
  assert rollout_values(t)[0][0] == 0.5


def test_trees_without_stage2_equal_backup():
  rs = np.random.RandomState(0)
  for _ in range(20):
    t = Tree([1], uid=0)
    n = rs.randint(1, 6)
    for i in range(n):
      node = t.add_node(0, gen_ids=[2], rollout=i)
      for _ in range(rs.randint(0, 3)):
        node = t.add_node(node.id, gen_ids=[3], rollout=i)
      node.done, node.reward = True, float(rs.rand() < 0.5)
    if rs.rand() < 0.5:
      t.meta["stage1_rollouts"] = n
    t.backup()
    values, counts = rollout_values(t)
    assert values == [x.value for x in t.nodes] and counts == [x.n_leaves for x in t.nodes]


def test_forked_anchor_targets_are_unbiased_under_outcome_selection():
  """Exact expectation over stage-1 outcomes r ~ Bernoulli(V) and k continuations ~ Binomial(k, V)
  at an anchor with success probability V, where stage 2 forks a only when one continuation is
  unlikely to repeat r (q_h = `repeat_prob`(p_hat, r) < 1/2, i.e. r contradicts p_hat = V). A
  predictor row per node (unit weight) must average V, and so must the visit-weighted fit (weight
  n_y) of the per-leaf pooled targets; the old pooled target with unit weight averaged 0.92."""
  v, k = 0.8, 3
  cases = []  # (probability, tree, anchor id)
  for r in (0, 1):
    picked = float(repeat_prob(v, r)) < 0.5
    for cont in (itertools.product((0, 1), repeat=k) if picked else [()]):
      prob = (v if r else 1 - v) * math.prod(v if c else 1 - v for c in cont)
      cases.append((prob, *forked_tree(r, cont)))
  assert sum(c[0] for c in cases) == pytest.approx(1.0)
  unit = sum(prob * rollout_values(t)[0][a] for prob, t, a in cases)
  assert unit == pytest.approx(v, abs=1e-9)  # the old pooled target: 0.92
  pooled = [(prob, *rollout_values(t, per_leaf=True), a) for prob, t, a in cases]
  visit = (sum(prob * n[a] * x[a] for prob, x, n, a in pooled)
           / sum(prob * n[a] for prob, x, n, a in pooled))
  assert visit == pytest.approx(v, abs=1e-9)
  assert sum(prob * x[a] for prob, x, _, a in pooled) == pytest.approx(0.92, abs=1e-9)
