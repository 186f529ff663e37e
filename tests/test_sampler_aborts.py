"""Sampler abort paths: a pool too full to start a branch, errors inside and before `run`, errors
while scoring a pool, weights swapped under rollouts in flight, and what each costs in the
ledger."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_sampler import PROMPTS, V, make_engine, model  # noqa: F401 (fixture)
from trace_jax.allocation.driver import trees_cost
from trace_jax.sampling.engine import ForkRequest, PromptRequest
from trace_jax.sampling.paged_kv import PoolExhaustedError
from trace_jax.sampling.testing import ScriptedEnv, check_against_forward, make_forward


def _ledger_delta(engine, before: dict) -> dict:
  return {k: v - before[k] for k, v in engine.ledger.as_dict().items()}


def _all_free(engine) -> bool:
  return engine.alloc.num_free == engine.alloc.capacity and not engine.alloc.refcount.any()


# ---- 1: a branch the pool cannot give its first pages --------------------------------------------
def test_a_full_pool_evicts_cached_kv_and_forks_recompute_it(model):  # noqa: F811
  """Forks and a new prompt while pages outside the engine's trees hold every free page: the
  trees' cached K/V is given back, each fork recomputes its anchor's prefix, and every branch
  samples what a plain forward gives (before preemption: each ended as an empty cut leaf)."""
  engine = make_engine(model)
  trees = engine.run([PromptRequest(p, n=1) for p in PROMPTS])
  anchors = [(t, a.id) for t in trees for a in t.anchors()]
  hog = engine.alloc.alloc(engine.alloc.num_free)
  before, counts = engine.ledger.as_dict(), [len(t.nodes) for t in trees]
  out = engine.run([ForkRequest(t, a, 2) for t, a in anchors] + [PromptRequest(PROMPTS[0], n=2)])
  new = [n for t, c in zip(trees, counts) for n in t.nodes[c:] if n.done] + out[-1].leaves()
  assert len(new) == 2 * len(anchors) + 2
  assert not [n for n in new if n.truncated == "pool_exhausted"]
  used = _ledger_delta(engine, before)
  assert used["recomputed_tokens"] > 0 and used["rollouts_started"] == len(new)
  assert all(st.outstanding == 0 for st in engine._trees.values())
  check_against_forward(trees + out[-1:], *model, greedy=True)
  engine.alloc.decref(hog)
  engine.release()
  assert _all_free(engine)


def test_a_shard_that_cannot_hold_a_rollout_alone_cuts_it(model):  # noqa: F811
  """The last resort: pages held outside the engine leave less than one rollout. A prompt that
  cannot get its first pages and a branch that runs dry with nothing to evict or preempt end as
  `pool_exhausted` leaves (system cuts), counted as rollouts; the run returns."""
  engine = make_engine(model)
  hog = engine.alloc.alloc(engine.alloc.num_free - 4)  # PROMPTS[1]: 1 prompt page + 1 copy
  first, starved = engine.run([PromptRequest(PROMPTS[1], n=1),
                               PromptRequest(PROMPTS[2], n=1)])  # 18 tokens: 5 pages
  assert [n.truncated for n in first.leaves()] == ["pool_exhausted"]
  assert first.leaves()[0].gen_ids  # it decoded until the shard ran dry
  assert [(n.truncated, n.gen_ids) for n in starved.leaves()] == [("pool_exhausted", [])]
  roomy = make_engine(model).run([PromptRequest(PROMPTS[1], n=1)])[0]
  ids = list(first.path_tokens(first.leaves()[0].id)[0])
  assert list(roomy.path_tokens(roomy.leaves()[0].id)[0])[:len(ids)] == ids  # a prefix of it
  engine.alloc.decref(hog)
  engine.release()
  assert _all_free(engine)


def test_a_branch_without_pages_waits_while_another_decodes(model):  # noqa: F811
  """Two branches that do not fit the pool together (nothing cached to evict): the later one is
  preempted or waits until the other gives its pages back, and both are sampled exactly as with
  a roomy pool; neither is cut."""
  reference = make_engine(model, num_slots=2).run([PromptRequest(p, n=1) for p in PROMPTS[:2]])
  engine = make_engine(model, num_slots=2)
  # 16 pages: either rollout alone fits (48 and 39 tokens: 12 and 10 pages), not both.
  hog = engine.alloc.alloc(engine.alloc.num_free - 16)
  heard = []

  def on_done(done):
    heard.append([t.uid for t in done])
    return []

  waited, first = engine.run([PromptRequest(PROMPTS[0], n=1), PromptRequest(PROMPTS[1], n=1)],
                             on_trees_done=on_done)
  assert sorted(u for h in heard for u in h) == sorted([waited.uid, first.uid])
  assert engine.ledger.preemptions > 0  # the two branches did not fit together
  for got, ref in zip((waited, first), reference):
    assert [leaf.truncated for leaf in got.leaves()] == [""]
    assert ([list(got.path_tokens(x.id)[0]) for x in got.leaves()] ==
            [list(ref.path_tokens(x.id)[0]) for x in ref.leaves()])
  check_against_forward([waited, first], *model, greedy=True)
  engine.alloc.decref(hog)
  engine.release()
  assert _all_free(engine)


def test_prompts_that_can_never_fit_are_refused_up_front(model):  # noqa: F811
  engine = make_engine(model, num_pages=16)  # 15 pages; an 88-token prompt needs 22
  with pytest.raises(PoolExhaustedError, match="KV pool exhausted") as e:
    engine.run([PromptRequest(PROMPTS[1], n=1), PromptRequest(list(range(2, 90)), n=1)])
  assert not engine.live_trees and _all_free(engine)  # nothing admitted
  assert "needs 22 pages" in str(e.value)
  with pytest.raises(ValueError, match="needs 25 pages"):  # one rollout: check_rollout_fits
    engine.check_rollout_fits()


# ---- 2: no fork over K/V an aborted run never wrote ----------------------------------------------
class _FailingObservation:
  """ScriptedEnv, except that the first batch in which two turns go on answers the second with
  text the tokenizer cannot encode: the error comes after the first's observation prefill was
  queued, before it ran."""

  def __init__(self):
    self.env, self.fired = ScriptedEnv(V), False

  def __call__(self, calls):
    out = self.env(calls)
    going = [i for i, (_, done, _) in enumerate(out) if not done]
    if not self.fired and len(going) >= 2:
      self.fired = True
      out[going[-1]] = ("w9 not-a-token", False, 0.0)
    return out


def _fork_what_the_engine_allows(engine, trees):
  """Forks one branch from every unfinished node the engine accepts; returns the refusals."""
  refused = []
  for t in trees:
    for n in t.nodes:
      if n.done:
        continue
      try:
        engine.run([ForkRequest(t, n.id, 1)])
      except ValueError as e:
        refused.append(str(e))
  return refused


def test_no_fork_reads_kv_that_an_aborted_run_never_wrote(model):  # noqa: F811
  """An error inside `run` drops the queued prefills (an observation after a turn, a prompt);
  the nodes whose K/V they would have written are no longer forkable, and every fork the engine
  still accepts samples what a plain forward gives (before the fix: other greedy tokens)."""
  engine = make_engine(model)
  engine.env_step = _FailingObservation()
  with pytest.raises(ValueError, match="ot-a-token"):
    engine.run([PromptRequest(p, n=2) for p in PROMPTS])
  assert all(b is None for b in engine.slots) and not engine._jobs
  trees = list(engine.live_trees.values())
  refused = _fork_what_the_engine_allows(engine, trees)
  check_against_forward(trees, *model, greedy=True)
  assert refused and all("no K/V" in e for e in refused)  # the node whose observation was queued
  engine.release()
  assert _all_free(engine)

  # An error in the middle of the prefills themselves (the third prefill call fails).
  engine = make_engine(model)
  prefill, calls = engine._prefill, []

  def failing_prefill(*args):
    calls.append(1)
    if len(calls) == 3:
      raise RuntimeError("device lost")
    return prefill(*args)

  engine._prefill = failing_prefill
  with pytest.raises(RuntimeError, match="device lost"):
    engine.run([PromptRequest(p, n=2) for p in PROMPTS])
  engine._prefill = prefill
  trees = list(engine.live_trees.values())
  refused = _fork_what_the_engine_allows(engine, trees)
  check_against_forward(trees, *model, greedy=True)
  assert refused and all("no K/V" in e for e in refused)
  engine.release()
  assert _all_free(engine)


# ---- 3: scoring a pool with keep=True leaks nothing on an error ----------------------------------
def test_scoring_with_keep_keeps_no_page_of_a_failed_call(model):  # noqa: F811
  engine = make_engine(model)
  engine.prompt_features(PROMPTS[:1], keep=True)  # kept from an earlier call: stays kept
  free = engine.alloc.num_free
  with pytest.raises(ValueError, match="prompt length 200"):
    engine.prompt_features([PROMPTS[1], PROMPTS[2], [5] * 200], keep=True)
  assert engine.alloc.num_free == free
  assert engine.kept_prompts == 1 and not engine._jobs
  prefill = engine._prefill

  def failing_prefill(*args):
    raise RuntimeError("device lost")

  engine._prefill = failing_prefill
  with pytest.raises(RuntimeError, match="device lost"):
    engine.prompt_features(PROMPTS[1:], keep=True)
  engine._prefill = prefill
  assert engine.alloc.num_free == free
  assert engine.kept_prompts == 1 and not engine._jobs
  engine.release()  # every kept page (the only ones left) goes back
  assert _all_free(engine)


# ---- 4: a refused call admits nothing ------------------------------------------------------------
def test_a_bad_request_after_good_ones_admits_nothing(model):  # noqa: F811
  engine = make_engine(model)
  trees = engine.run([PromptRequest(p, n=1) for p in PROMPTS[:2]])
  tree, leaf = trees[0], trees[0].leaves()[0]
  uid = engine._next_uid
  with pytest.raises(ValueError, match="finished leaf"):
    engine.run([ForkRequest(tree, 0, 2), PromptRequest(PROMPTS[2], n=1),
                ForkRequest(tree, leaf.id, 1)])
  with pytest.raises(ValueError, match="prompt length 0"):
    engine.run([PromptRequest(PROMPTS[2], n=1), PromptRequest([], n=1)])
  with pytest.raises(ValueError, match="uid 77"):
    engine.run([PromptRequest(PROMPTS[2], n=1, uid=77), PromptRequest(PROMPTS[1], n=1, uid=77)])
  assert engine._next_uid == uid and set(engine.live_trees) == {t.uid for t in trees}
  assert all(st.outstanding == 0 for st in engine._trees.values())
  assert not any(engine._pending.values())
  # The tree is still reported when its next rollouts finish.
  heard = []
  engine.run([ForkRequest(tree, 0, 1)], on_trees_done=lambda done: heard.extend(done) or [])
  assert heard == [tree]
  # A refused call that would adopt rollouts started ahead leaves them carried.
  engine = make_engine(model, num_slots=8)
  first = engine.run([PromptRequest(PROMPTS[0], n=2)], ahead=[PromptRequest(PROMPTS[1], n=3)])
  carried = engine.carried
  with pytest.raises(ValueError, match="prompt length"):
    engine.run([PromptRequest([], n=1)], adopt=True)
  assert engine.carried == carried
  adopted = engine.run([], adopt=True)
  assert adopted == carried and len(adopted[0].leaves()) == 3
  engine.release(first + adopted)
  assert _all_free(engine)


# ---- 5: tokens sampled by new weights over old K/V are counted as stale --------------------------
def _matches_forward(tree, leaf_id, fwd, state) -> bool:
  """Whether every generated token's recorded log-prob is a plain forward's under `state`."""
  ids, mask, _, lps = tree.path_tokens(leaf_id)
  logp = jax.nn.log_softmax(jax.device_get(fwd(state, jnp.asarray(ids)[None])[0]), axis=-1)
  return all(abs(lps[t] - logp[t - 1, ids[t]]) < 2e-4 for t in np.nonzero(mask)[0])


def _first_nodes(tree) -> dict:
  """rollout index -> the node it was started from (its first node's parent)."""
  first = {}
  for n in tree.nodes[1:]:
    first.setdefault(n.rollout, n.parent)
  return first


def test_tokens_over_kv_of_replaced_weights_are_stale(model):  # noqa: F811
  """After `update_params`: a rollout in flight continues over its old K/V and a fork from a node
  recorded under the old weights samples over it: all their tokens count in
  `meta["stale_tokens"]` (before the fix: only the tokens generated before the swap). Rollouts
  started from a root after the swap prefill the prompt again and sample from the new weights
  (their log-probs are a plain forward's), also while old ones of the same tree still decode."""
  new_state = jax.tree.map(lambda x: x * 0.9, model[1])
  # (Sampled: rollouts of one prompt differ in length, so some are in flight at the swap.)
  engine = make_engine(model, num_slots=8, greedy=False, seed=2)
  step1 = [PromptRequest(PROMPTS[0], n=4, uid=1)]
  step2 = [PromptRequest(p, n=3, uid=30 + i) for i, p in enumerate(PROMPTS)]
  t1 = engine.run(step1, ahead=step2)
  engine.update_params(new_state)
  carried = engine.carried
  at_swap = ({(t.uid, n.rollout) for t in carried for n in t.nodes[1:]} |
             {(b.tree.uid, b.serial) for b in engine.slots if b is not None})
  stale_at_swap = sum(t.meta["stale_tokens"] for t in carried)
  assert any(b is not None for b in engine.slots) and any(engine._ahead_pending.values())
  # The tree kernel reads a group's prefix pages once for all its branches: an old branch of a
  # root and a new one (its prompt prefilled again) must not form one group.
  step, groups = engine._step, []

  def checked_step(decoding, *args):
    prefix = {}
    for i in decoding:
      b = engine.slots[i]
      if b.shared_pages:
        prefix.setdefault(b.group_key, set()).add(tuple(b.pages[:b.shared_pages]))
        groups.append(b.group_key[:2])
    assert all(len(v) == 1 for v in prefix.values()), prefix
    return step(decoding, *args)

  engine._step = checked_step
  t2 = engine.run([], adopt=True)
  engine._step = step
  assert len(set(groups)) < len(groups)  # branches of one anchor decoded together

  def expected(t):
    return sum(len(n.gen_ids) for n in t.nodes[1:] if (t.uid, n.rollout) in at_swap)

  assert [t.meta["stale_tokens"] for t in t2] == [expected(t) for t in t2]
  assert sum(map(expected, t2)) > stale_at_swap  # rollouts in flight went on after the swap
  fwd = make_forward(model[0])
  clean = [(t, leaf.id) for t in t2 for leaf in t.leaves() if (t.uid, leaf.rollout) not in at_swap]
  assert clean and all(_matches_forward(t, i, fwd, new_state) for t, i in clean)
  # Stage 2 after the adoption: forks from nodes of old rollouts are stale, from roots clean.
  marks = {t.uid: (t.meta["stale_tokens"], len(t.nodes)) for t in t2}
  firsts = {t.uid: _first_nodes(t) for t in t2}
  engine.run([ForkRequest(t, a.id, 1) for t in t2 for a in t.anchors() if a.depth <= 1])
  kinds = set()
  for t in t2:
    stale0, n0 = marks[t.uid]
    new = [n for n in t.nodes[n0:]]
    old_anchor = {r: a != 0 and (t.uid, t.nodes[a].rollout) in at_swap
                  for r, a in _first_nodes(t).items() if r not in firsts[t.uid]}
    kinds |= set(old_anchor.values())
    assert t.meta["stale_tokens"] - stale0 == sum(len(n.gen_ids) for n in new
                                                  if old_anchor[n.rollout])
    assert all(_matches_forward(t, n.id, fwd, new_state) for n in new
               if n.done and not old_anchor[n.rollout])
  assert kinds == {True, False}
  engine.release(t1 + t2)
  assert _all_free(engine)


# ---- accounting ----------------------------------------------------------------------------------
def test_a_pool_scored_ahead_is_charged_to_the_step_that_samples_it(model):  # noqa: F811
  """The next step's pool is scored during this step (its rollouts start ahead): its prefill
  goes to `ahead_ledger` and to the ledger of the run that adopts them, not this one's."""
  pool_a, pool_b = PROMPTS[:2], PROMPTS[1:] + [[7, 8, 9, 10, 11]]
  engine = make_engine(model, num_slots=8)
  before = engine.ledger.as_dict()
  engine.prompt_features(pool_a)  # this step's pool
  engine.prompt_features(pool_b)  # the next step's
  a1 = engine.run([PromptRequest(p, n=2) for p in pool_a],
                  ahead=[PromptRequest(p, n=2) for p in pool_b[:2]])
  used = _ledger_delta(engine, before)
  assert used["prefill_tokens"] == trees_cost(a1)["prefill_tokens"] + sum(map(len, pool_a))
  before = engine.ledger.as_dict()
  a2 = engine.run([], adopt=True)
  used = _ledger_delta(engine, before)
  assert used["prefill_tokens"] == trees_cost(a2)["prefill_tokens"] + sum(map(len, pool_b))
  assert engine.ahead_ledger.prefill_tokens == 0
  engine.release(a1 + a2)
  assert _all_free(engine)


@pytest.mark.parametrize("kw,cut", [(dict(max_seq_len=30, max_turns=3), "max_seq_len"),
                                    (dict(num_pages=15, max_seq_len=48), "")])
def test_trees_cost_agrees_with_the_ledger_on_cuts_after_the_env(model, kw, cut):  # noqa: F811
  """A turn the sequence limit cuts after the environment answered (no room for its
  observation) made a tool call, and a turn preempted for its observation's pages prefills that
  observation once, at its resume (the rest of the resume is recomputed, counted apart):
  `trees_cost` agrees with the ledger."""
  engine = make_engine(model, **kw)
  before = engine.ledger.as_dict()
  trees = engine.run([PromptRequest(p, n=3) for p in PROMPTS[:2]])
  used = _ledger_delta(engine, before)
  cost = trees_cost(trees)
  assert {k: used[k] for k in cost} == cost
  if cut:
    assert any(n.truncated == cut and n.obs_text for t in trees for n in t.nodes)  # after the env
  else:
    assert used["preemptions"] > 0 and used["recomputed_tokens"] > 0
    assert not [n for t in trees for n in t.nodes if n.truncated == "pool_exhausted"]
  engine.release(trees)
