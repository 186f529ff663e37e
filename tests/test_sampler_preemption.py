"""A full KV pool preempts instead of cutting (`sampling.engine_preempt`): cached K/V is evicted,
branches are suspended and resumed by recomputing their K/V, and the trees come out as an ample
pool samples them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_sampler import PROMPTS, V, leaf_sequences, make_engine, model, two_stage  # noqa: F401
from trace_jax.sampling.engine import ForkRequest, PromptRequest
from trace_jax.sampling.engine_ops import sample_tokens
from trace_jax.sampling.testing import check_against_forward, make_forward


def _leaves(trees) -> list[dict]:
  """Per tree: leaf token path -> (behaviour log-probs, reward, truncation)."""
  out = []
  for t in trees:
    d = {}
    for leaf in t.leaves():
      ids, _, _, lps = t.path_tokens(leaf.id)
      d[tuple(int(x) for x in ids)] = (lps, leaf.reward, leaf.truncated)
    out.append(d)
  return out


def _sample(mdl, greedy, **kw):
  engine = make_engine(mdl, greedy=greedy, temperature=1.0, **kw)
  engine.alloc.peak = 0
  trees = two_stage(engine, n=3, k=2)
  return engine, trees


@pytest.mark.parametrize("num_pages", [40, 26])  # 26: one rollout (24 pages) and its copy
def test_a_small_pool_samples_the_trees_an_ample_one_does(model, num_pages):  # noqa: F811
  """Greedy two-stage trees (stage-2 forks from every anchor) with a pool far below the need:
  the same trees, rewards and log-probs (to float rounding: recomputed K/V comes from a prefill,
  not the decode step that first wrote it), no cut, every token what a plain forward gives;
  preemptions and recomputed tokens counted; the ledger's other counts unchanged; every page back
  after release."""
  big, ample = _sample(model, greedy=True)
  small, tight = _sample(model, greedy=True, num_pages=num_pages)
  assert big.alloc.peak > 4 * num_pages  # the ample pool's peak: far above the small pool
  assert small.alloc.peak <= small.alloc.capacity
  assert leaf_sequences(tight) == leaf_sequences(ample)
  for a, b in zip(_leaves(ample), _leaves(tight)):
    for key, (lps, reward, cut) in a.items():
      np.testing.assert_allclose(b[key][0], lps, atol=5e-5, rtol=0)
      assert b[key][1:] == (reward, cut)
  assert not [n for t in tight for n in t.nodes if n.truncated == "pool_exhausted"]
  check_against_forward(tight, *model, greedy=True)
  led_a, led_s = big.ledger.as_dict(), small.ledger.as_dict()
  assert led_s["preemptions"] > 0 and led_s["recomputed_tokens"] > 0
  assert led_a["preemptions"] == led_a["recomputed_tokens"] == 0
  for k in ("rollouts_started", "generated_tokens", "prefill_tokens", "tool_calls"):
    assert led_s[k] == led_a[k], k
  small.release()
  assert small.alloc.num_free == small.alloc.capacity and small.alloc.in_use == 0


def test_sampled_trees_differ_only_where_rounding_can_flip_a_draw(model):  # noqa: F811
  """Sampling at temperature 1 with a tight pool: every leaf of the ample pool's trees is sampled
  again token for token, except where the draw sat within rounding of a boundary of the
  inverse-CDF sampler. For every leaf that differs, at its first differing token (same prefix,
  same rng key and counter) the uniform draw lies within 1e-4 of the cumulative probability that
  separates the two tokens, under a plain forward's distribution: recomputed K/V, equal to the
  decode-written one up to rounding, is the only cause."""
  big, ample = _sample(model, greedy=False)
  small, tight = _sample(model, greedy=False, num_pages=26)
  assert small.ledger.preemptions > 0
  fwd = make_forward(model[0])
  same = flips = 0
  for ta, tb in zip(ample, tight):
    paths_b = {leaf.rollout: tb.path_tokens(leaf.id)[0] for leaf in tb.leaves()}
    for leaf in ta.leaves():
      a, mask, owner, _ = ta.path_tokens(leaf.id)
      b = paths_b[leaf.rollout]
      if len(a) == len(b) and (a == b).all():
        same += 1
        continue
      n = min(len(a), len(b))
      t = int(np.argmax(a[:n] != b[:n]))
      # The branch that drew the token at t, and its rng counter there: the tokens it had drawn.
      serial = ta.nodes[int(owner[t])].rollout
      drawn = [i for i in range(t) if mask[i] and ta.nodes[int(owner[i])].rollout == serial]
      key = np.random.SeedSequence([big.cfg.seed, ta.uid, serial]).generate_state(2, np.uint32)
      u = float(jax.random.uniform(jax.random.fold_in(
          jax.random.wrap_key_data(jnp.asarray(key), impl="threefry2x32"), len(drawn)), ()))
      logits, _ = jax.device_get(fwd(model[1], jnp.asarray(a[:t])[None]))
      cdf = np.cumsum(np.asarray(jax.nn.softmax(jnp.asarray(logits[-1], jnp.float32))))
      lo, hi = sorted((int(a[t]), int(b[t])))
      assert hi == lo + 1, (ta.uid, serial, t)  # neighbours in the inverse CDF
      assert abs(u - cdf[lo]) < 1e-4, (ta.uid, serial, t, u, cdf[lo])
      flips += 1
  assert same > 3 * flips  # most rollouts are sampled again exactly


def test_preemption_keeps_features_and_streams_a_second_stage(model):  # noqa: F811
  """Forks streamed into the same run (`on_trees_done`) under a tight pool give the trees of two
  runs with an ample pool, with every node's prefix feature where the plain forward has it."""
  reference = leaf_sequences(two_stage(make_engine(model)))
  engine = make_engine(model, num_pages=30)

  def on_done(trees):
    return [ForkRequest(t, a.id, 2) for t in trees for a in t.anchors()
            if a.depth in (0, 1, 2) and len(t.leaves()) == 2]

  trees = engine.run([PromptRequest(p, n=2) for p in PROMPTS], on_trees_done=on_done)
  assert leaf_sequences(trees) == reference
  assert engine.ledger.preemptions > 0
  stats = check_against_forward(trees, *model, greedy=True)
  assert stats["features"] > 20
  assert all(n.feature is not None for t in trees for n in t.nodes)


def test_synchronous_turns_with_a_tight_pool(model):  # noqa: F811
  """Turn barriers (`sync_turns`): branches waiting at the barrier are never preempted; the
  branch in need preempts itself and resumes after; the trees equal the ample pool's."""
  requests = [PromptRequest(p, n=3) for p in PROMPTS]
  reference = leaf_sequences(make_engine(model).run(requests, sync_turns=True))
  engine = make_engine(model, num_pages=30)
  trees = engine.run(requests, sync_turns=True, sync_refill=True)
  assert leaf_sequences(trees) == reference
  assert not [n for t in trees for n in t.nodes if n.truncated == "pool_exhausted"]
  check_against_forward(trees, *model, greedy=True)


def test_rollouts_ahead_survive_preemption_and_adoption(model):  # noqa: F811
  """Rollouts started ahead in a tight pool may be preempted while carried; adopted by the next
  run they finish as with an ample pool."""
  first = [PromptRequest(p, n=2) for p in PROMPTS[:2]]
  ahead = [PromptRequest(p, n=2) for p in PROMPTS[1:]]
  ref = make_engine(model)
  ref_a = ref.run(first, ahead=ahead)
  ref_b = ref.run([], adopt=True)
  engine = make_engine(model, num_pages=28)
  got_a = engine.run(first, ahead=ahead)
  got_b = engine.run([], adopt=True)
  assert leaf_sequences(got_a) == leaf_sequences(ref_a)
  assert leaf_sequences(got_b) == leaf_sequences(ref_b)
  assert engine.ledger.preemptions + engine.ledger.recomputed_tokens > 0
  check_against_forward(got_a + got_b, *model, greedy=True)
  engine.release()
  assert engine.alloc.num_free == engine.alloc.capacity


def test_sampling_is_independent_of_the_slot_and_call(model):  # noqa: F811
  """What preemption relies on: a branch's token depends only on its logits, rng key and counter
  (not on its slot or the decode call), so a resumed branch draws what it would have drawn."""
  logits = jax.random.normal(jax.random.PRNGKey(0), (3, V)) * 3
  keys = np.asarray([[1, 2], [1, 2], [3, 4]], np.uint32)
  counters = np.asarray([5, 5, 5], np.int32)
  args = (np.ones(3, np.float32), np.ones(3, np.float32), np.zeros(3, np.int32),
          np.zeros(3, bool))
  tok, lp, _ = sample_tokens(jnp.stack([logits[0], logits[0], logits[2]]), keys, counters, *args)
  tok2, lp2, _ = sample_tokens(jnp.stack([logits[2], logits[0], logits[1]]),
                               keys[[2, 0, 1]], counters, *args)
  assert int(tok[0]) == int(tok[1]) == int(tok2[1]) and int(tok[2]) == int(tok2[0])
  assert float(lp[0]) == float(lp2[1])
