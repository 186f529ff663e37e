"""Sampler engine: token-by-token agreement with a plain forward, forks, limits, pool,
compilation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trace_jax.models.qwen3 import Qwen3, get_preset
from trace_jax.sampling.engine_ops import sample_tokens
from trace_jax.sampling.engine import ForkRequest, PromptRequest, SamplerConfig, SamplerEngine
from trace_jax.sampling.testing import IdTokenizer, ScriptedEnv, check_against_forward

V = 64
EOS, SEARCH, ANSWER = 1, 5, 6
TOK = IdTokenizer({SEARCH: "</search>", ANSWER: "</answer>"})
PROMPTS = [[3, 9, 12, 17, 22, 30, 41], [10, 11, 12], list(range(20, 38))]


@pytest.fixture(scope="module")
def model():
  gd, st = nnx.split(Qwen3(get_preset("tiny", vocab_size=V), rngs=nnx.Rngs(0)))
  # A random init at std 0.02 barely depends on its input (greedy repeats one token); larger
  # weights make every branch's tokens differ, so a wrong K/V page would show up in the tokens.
  st = jax.tree.map(lambda x: x * 6.0, st)
  return gd, st


def make_engine(model, **kw):
  base = dict(num_slots=4, page_size=4, num_pages=512, max_seq_len=96, max_turn_tokens=7,
              max_obs_tokens=12, max_turns=4, prefill_chunk=(16,), page_buckets=(24,), greedy=True,
              max_group_size=2, max_groups=2)
  base.update(kw)
  return SamplerEngine(model[0], model[1], SamplerConfig(**base), TOK.encode, TOK.decode,
                       ScriptedEnv(V), eos_id=EOS)


def two_stage(engine, n=2, k=2):
  trees = engine.run([PromptRequest(p, n=n) for p in PROMPTS])
  forks = [ForkRequest(t, a.id, k) for t in trees for a in t.anchors() if a.depth in (0, 1, 2)]
  engine.run(forks)
  return trees


def leaf_sequences(trees):
  return [sorted(tuple(t.path_tokens(leaf.id)[0]) for leaf in t.leaves()) for t in trees]


def test_greedy_forks_match_plain_forward(model):
  engine = make_engine(model)
  free0 = engine.alloc.num_free
  trees = two_stage(engine)
  depths = {n.depth for t in trees for n in t.nodes if len(n.children) > 1}
  assert {0, 1, 2} <= depths  # branching at the root and at two turn boundaries
  stats = check_against_forward(trees, *model, greedy=True)
  assert stats["tokens"] > 200 and stats["features"] > 20
  # Every node has its prefix feature (leaves too, via the extra step).
  assert all(n.feature is not None for t in trees for n in t.nodes)
  # Prompt features before sampling (stage-1 predictions) equal the recorded root features.
  feats = engine.prompt_features(PROMPTS)
  np.testing.assert_allclose(feats, np.stack([t.root.feature for t in trees]), atol=2e-4)
  led = engine.ledger
  assert led.generated_tokens == sum(len(n.gen_ids) for t in trees for n in t.nodes)
  assert led.rollouts_started == sum(len(t.nodes[0].children) for t in trees) + sum(
      len(n.children) - 1 for t in trees for n in t.nodes[1:] if n.children)
  assert led.tool_calls == engine.env_step.calls
  engine.release(trees)
  assert engine.alloc.num_free == free0 and not engine.alloc.refcount.any()


def test_tree_attention_equals_plain_paged_attention(model):
  a = two_stage(make_engine(model, use_tree_attention=True))
  b = two_stage(make_engine(model, use_tree_attention=False))
  assert leaf_sequences(a) == leaf_sequences(b)
  # Without prefix sharing (every fork copies all pages): same tokens, more pages.
  shared, copied = make_engine(model), make_engine(model, share_prefix=False)
  c = two_stage(copied)
  assert leaf_sequences(c) == leaf_sequences(two_stage(shared))
  assert copied.alloc.num_free < shared.alloc.num_free
  # Sampled too: same per-branch keys, so the same tokens.
  a = make_engine(model, greedy=False, seed=3).run([PromptRequest(p, n=3) for p in PROMPTS])
  b = make_engine(model, greedy=False, seed=3, use_tree_attention=False).run(
      [PromptRequest(p, n=3) for p in PROMPTS])
  assert leaf_sequences(a) == leaf_sequences(b)
  check_against_forward(a, *model, greedy=False)


def test_no_compilation_after_warmup(model):
  engine = make_engine(model, greedy=False)
  two_stage(engine)  # warm-up: every bucket this workload uses
  before = engine.compile_counts()
  engine.update_params(jax.tree.map(lambda x: x * 1.01, engine.state))  # same shapes: no retrace
  compiles = []

  def listener(name, *args, **kwargs):
    compiles.append(name)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    two_stage(engine)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert engine.compile_counts() == before
  assert not [c for c in compiles if "backend_compile" in c], compiles


def test_limits_are_recorded(model):
  engine = make_engine(model, max_seq_len=30, max_turns=2)
  trees = engine.run([PromptRequest(p, n=2) for p in PROMPTS])
  for t in trees:
    for leaf in t.leaves():
      assert t.prefix_len(leaf.id) <= 30
      assert leaf.depth <= 2
      assert leaf.truncated in ("", "max_seq_len", "max_turns")
    for n in t.nodes[1:]:
      assert len(n.gen_ids) <= 7
      assert len(n.obs_ids) <= 12
      assert n.gen_ids[-1] in (SEARCH, ANSWER, EOS) or len(n.gen_ids) == 7 or n.truncated
  reasons = {leaf.truncated for t in trees for leaf in t.leaves()}
  assert {"max_seq_len", "max_turns"} <= reasons
  check_against_forward(trees, *model, greedy=True)


def test_checkpoint_rollback_drops_a_round_of_forks(model):
  engine = make_engine(model, greedy=False, seed=5)
  trees = engine.run([PromptRequest(PROMPTS[0], n=2)])
  tree, free = trees[0], engine.alloc.num_free
  mark = engine.checkpoint(tree)
  anchors = [a.id for a in tree.anchors()]
  engine.run([(tree, a, 2) for a in anchors])
  first = leaf_sequences([tree])
  assert engine.alloc.num_free < free and len(tree.nodes) > mark[0]
  engine.rollback(tree, mark)
  assert engine.alloc.num_free == free and len(tree.nodes) == mark[0]
  assert all(c < mark[0] for n in tree.nodes for c in n.children)
  engine.tree_state(tree).branches = 2  # replay the same branch keys: the same continuations
  engine.run([(tree, a, 2) for a in anchors])
  assert leaf_sequences([tree]) == first
  engine.release()
  assert engine.alloc.num_free == engine.alloc.capacity


def test_fork_errors(model):
  engine = make_engine(model)
  trees = engine.run([PromptRequest(PROMPTS[0], n=2)])
  leaf = trees[0].leaves()[0]
  with pytest.raises(ValueError, match="finished"):
    engine.run([(trees[0], leaf, 1)])
  engine.release(trees)
  with pytest.raises(ValueError, match="released"):
    engine.run([(trees[0], 1, 1)])


def test_sample_tokens():
  logits = jax.random.normal(jax.random.key(0), (4, 16)) * 2
  keys = np.tile(np.asarray([[0, 7]], np.uint32), (4, 1))
  cnt = np.arange(4, dtype=np.int32)
  f = lambda t, p, k, g: sample_tokens(logits, keys, cnt, jnp.full(4, t), jnp.full(4, p),
                                       jnp.full(4, k, jnp.int32), jnp.full(4, g))
  best = np.argmax(np.asarray(logits), -1)
  assert (np.asarray(f(1.0, 1.0, 0, True)[0]) == best).all()
  assert (np.asarray(f(1.0, 1.0, 1, False)[0]) == best).all()  # top-k 1
  assert (np.asarray(f(1.0, 1e-6, 0, False)[0]) == best).all()  # nucleus of one token
  tok, lp, ent = f(1.0, 1.0, 0, False)
  logp = jax.nn.log_softmax(logits)
  np.testing.assert_allclose(lp, logp[np.arange(4), tok], rtol=1e-6)
  np.testing.assert_allclose(ent, -(jnp.exp(logp) * logp).sum(-1), rtol=1e-5)
  # Empirical frequencies follow the tempered, top-k-filtered distribution.
  row = jnp.tile(logits[:1], (4000, 1))
  keys = np.tile(np.asarray([[1, 2]], np.uint32), (4000, 1))
  tok, _, _ = sample_tokens(row, keys, np.arange(4000, dtype=np.int32), jnp.full(4000, 0.7),
                            jnp.ones(4000), jnp.full(4000, 5, jnp.int32), jnp.zeros(4000, bool))
  top5 = np.argsort(-np.asarray(logits[0]))[:5]
  p = np.asarray(jax.nn.softmax(logits[0, top5] / 0.7))
  freq = np.asarray([(np.asarray(tok) == t).mean() for t in top5])
  assert set(np.unique(np.asarray(tok))) <= set(top5.tolist())
  np.testing.assert_allclose(freq, p, atol=0.03)
  # The same through the static top-k cap (lax.top_k instead of a sort).
  tok2, _, _ = sample_tokens(row, keys, np.arange(4000, dtype=np.int32), jnp.full(4000, 0.7),
                             jnp.ones(4000), jnp.full(4000, 5, jnp.int32), jnp.zeros(4000, bool),
                             max_top_k=5)
  np.testing.assert_array_equal(tok2, tok)
  # No filter: plain tempered softmax over the whole vocabulary.
  tok3, _, _ = sample_tokens(row, keys, np.arange(4000, dtype=np.int32), jnp.full(4000, 2.0),
                             jnp.ones(4000), jnp.zeros(4000, jnp.int32), jnp.zeros(4000, bool),
                             nucleus=False)
  freq = np.bincount(np.asarray(tok3), minlength=16) / 4000
  np.testing.assert_allclose(freq, jax.nn.softmax(logits[0] / 2.0), atol=0.03)


def test_observation_cut_by_room_keeps_closing_tag():
  # A cut for lack of room (max_seq_len) keeps the caller's closing marker last, like the env's
  # token cap; without a marker (the default) it is a plain prefix.
  import functools
  import types
  vocab = {}
  enc = lambda s: [vocab.setdefault(w, len(vocab)) for w in s.replace("<", " <").split()]  # noqa
  text = "<information> a b c d e f g h i j </information>"
  engine = types.SimpleNamespace(encode=enc, observation_close="</information>")
  fit = functools.partial(SamplerEngine._fit_observation, engine)
  assert fit(text, 100) == enc(text)  # fits: untouched
  close = enc("</information>")
  cut = fit(text, 6)
  assert len(cut) == 6 and cut[-len(close):] == close and cut[:5] == enc(text)[:5]
  assert fit("plain words only here", 2) == enc("plain words")  # no tag: plain prefix
  assert fit(text, 0) == []
  engine.observation_close = ""  # no marker named: a plain prefix
  assert fit(text, 6) == enc(text)[:6]
  # The environments' protocol helper is this one (no second copy of the cut).
  from trace_jax.envs import react
  from trace_jax.sampling.observation import truncate_observation
  assert react.truncate_observation is truncate_observation


def test_multi_step_decode_equals_one_step_per_call(model):
  # Several decode steps per device call (stops, EOS and limits on the device) give the trees of
  # one step per call, greedy and sampled, in far fewer device calls. (Sampled forks are left out:
  # node ids follow the turn-end order, so forks listed by anchor id draw other branch keys.)
  for greedy in (True, False):
    run = two_stage if greedy else (lambda e: e.run([PromptRequest(p, n=3) for p in PROMPTS]))
    one = run(make_engine(model, decode_steps=1, greedy=greedy, seed=2))
    engine = make_engine(model, decode_steps=8, greedy=greedy, seed=2)
    calls = []
    step = engine._decode
    engine._decode = lambda *a: calls.append(1) or step(*a)
    many = run(engine)
    assert leaf_sequences(many) == leaf_sequences(one)

    def lps(trees):  # path log-probs in leaf order (node ids follow the scheduling order)
      paths = sorted((tuple(t.path_tokens(x.id)[0]), list(t.path_tokens(x.id)[3]))
                     for t in trees for x in t.leaves())
      return np.concatenate([p[1] for p in paths])
    np.testing.assert_allclose(lps(many), lps(one), atol=1e-4)  # co-batched slots differ
    assert engine.ledger.decode_steps < engine.ledger.generated_tokens
    assert 3 * len(calls) < engine.ledger.generated_tokens
  # A tokenizer whose stop tags have no token ids: the device runs past the tags, the host's text
  # check ends the turn at the same token and drops the rest (lengths, rng counters, pages).
  def encode(text):
    if "<" in text:
      raise KeyError(text)
    return TOK.encode(text)

  cfg = dict(num_slots=4, page_size=4, num_pages=512, max_seq_len=96, max_turn_tokens=7,
             max_obs_tokens=12, max_turns=4, prefill_chunk=(16,), page_buckets=(24,),
             greedy=True, max_group_size=2, max_groups=2, decode_steps=8)
  host_only = SamplerEngine(model[0], model[1], SamplerConfig(**cfg), encode, TOK.decode,
                            ScriptedEnv(V), eos_id=EOS)
  assert host_only.stop_width == 1  # no stop sequences on the device
  trees = two_stage(host_only)
  assert leaf_sequences(trees) == leaf_sequences(two_stage(make_engine(model, decode_steps=1)))
  assert any(n.gen_ids[-1] in (SEARCH, ANSWER) and len(n.gen_ids) < 7
             for t in trees for n in t.nodes[1:])
  host_only.release()
  assert host_only.alloc.num_free == host_only.alloc.capacity


def test_check_rollout_fits_names_the_pages_needed(model):
  eng = make_engine(model, num_pages=26)  # 25 usable pages; max_seq_len 96 / page_size 4 = 24
  eng.check_rollout_fits()  # 24 pages and one for an anchor's partial-page copy
  small = make_engine(model, num_pages=25)
  with pytest.raises(ValueError, match=r"up to 24 pages .* needs 25 pages on one shard, but the "
                                       r"pool holds 24 \(num_pages 25\); raise num_pages to at "
                                       r"least 26"):
    small.check_rollout_fits()


def test_on_trees_done_streams_a_second_stage_into_the_same_run(model):
  """Forks requested by the callback run in the same `run` and give the same trees as two runs
  (greedy sampling: a branch's tokens do not depend on when it runs); the callback hears of each
  tree once per wave of its rollouts, in the order the trees went idle."""
  reference = leaf_sequences(two_stage(make_engine(model)))
  engine = make_engine(model)
  heard = []

  def on_done(trees):
    heard.append([t.uid for t in trees])
    first = [t for t in trees if sum(u == t.uid for w in heard for u in w) == 1]
    return [ForkRequest(t, a.id, 2) for t in first for a in t.anchors() if a.depth in (0, 1, 2)]

  trees = engine.run([PromptRequest(p, n=2) for p in PROMPTS], on_trees_done=on_done)
  assert leaf_sequences(trees) == reference
  counts = {t.uid: sum(u == t.uid for w in heard for u in w) for t in trees}
  assert all(c == 2 for c in counts.values()), counts  # after stage 1, after its forks
  assert len(heard) > 1  # not all at once
  assert all(st.outstanding == 0 for st in engine._trees.values())
  engine.release(trees)
  # A callback that raises stops the run and leaves no page held by a slot.
  engine = make_engine(model)

  def boom(trees):
    raise RuntimeError("callback failed")

  with pytest.raises(RuntimeError, match="callback failed"):
    engine.run([PromptRequest(p, n=2) for p in PROMPTS], on_trees_done=boom)
  assert all(b is None for b in engine.slots)
  engine.release()
  assert engine.alloc.num_free == engine.alloc.capacity and not engine.alloc.refcount.any()


def test_scored_pool_keeps_its_kv_for_the_prompts_sampled(model):
  """prompt_features(keep=True) prefills the pool once: its features equal the plain forward's,
  the prompts then sampled reuse the kept pages (no second prefill; the same tokens as without
  keeping, greedy and sampled), the others' pages are released when the run ends, and 50 rounds
  of score, sample, fork, release leak no page."""
  pool = PROMPTS + [[7, 8, 9, 10, 11, 12, 13, 14, 15], [2, 3, 4, 5]]
  for greedy in (True, False):
    plain, kept = make_engine(model, greedy=greedy), make_engine(model, greedy=greedy)
    free0 = kept.alloc.num_free
    f_plain = plain.prompt_features(pool)
    f_kept = kept.prompt_features(pool, keep=True)
    np.testing.assert_allclose(f_kept, f_plain, atol=2e-4)
    assert kept.kept_prompts == len(pool) and kept.alloc.num_free < free0
    scored = kept.ledger.prefill_tokens
    assert scored == sum(map(len, pool)) == plain.ledger.prefill_tokens
    chosen = [pool[0], pool[3]]
    a = plain.run([PromptRequest(p, n=3) for p in chosen])
    b = kept.run([PromptRequest(p, n=3) for p in chosen])
    assert leaf_sequences(a) == leaf_sequences(b)
    # Sampling prefilled the chosen prompts again without keeping; with it, only the same
    # observations (identical rollouts) as the plain engine.
    assert plain.ledger.prefill_tokens - kept.ledger.prefill_tokens == sum(
        len(p) - 1 for p in chosen)
    assert kept.kept_prompts == 0  # the unchosen prompts' pages went back as the run started
    check_against_forward(b, *model, greedy=greedy)
    kept.release(b)
    assert kept.alloc.num_free == free0 and not kept.alloc.refcount.any()
  engine = make_engine(model, greedy=False)
  free0 = engine.alloc.num_free
  rng = np.random.default_rng(0)
  for i in range(50):
    engine.prompt_features(pool, keep=True)
    pick = [pool[j] for j in rng.choice(len(pool), size=2, replace=False)]
    if i % 5 == 4:  # new weights before sampling: the kept pages are stale and go back
      engine.update_params(model[1])
      assert engine.kept_prompts == 0
    trees = engine.run([PromptRequest(p, n=2) for p in pick])
    engine.run([ForkRequest(t, a.id, 1) for t in trees for a in t.anchors() if a.depth == 1])
    if i % 7 == 6:  # an evaluation's release of everything drops kept pages too
      engine.prompt_features(pool, keep=True)
      engine.release()
    else:
      engine.release(trees)
    assert engine.alloc.num_free == free0 and not engine.alloc.refcount.any(), i
  with pytest.raises(ValueError, match="count as prefill"):
    engine.prompt_features(pool, count_prefill=False, keep=True)


def test_scoring_with_keep_falls_back_when_the_pool_is_full(model):
  engine = make_engine(model, num_pages=16, max_seq_len=40)
  pool = [list(range(2, 16))] + [[3 + i, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13] for i in range(6)]
  f = engine.prompt_features(pool, keep=True)
  np.testing.assert_allclose(f, make_engine(model, num_pages=16, max_seq_len=40)
                             .prompt_features(pool), atol=2e-4)
  assert 0 < engine.kept_prompts < len(pool)  # some kept, the rest scored the plain way
  engine.drop_kept()
  assert engine.alloc.num_free == 16 - engine.shards  # every page back (less the null page)


def _tree_tokens(trees):
  return [[(n.parent, tuple(n.gen_ids), tuple(n.obs_ids)) for n in t.nodes] for t in trees]


def _same_logprobs(a, b):  # other rows in the batch move them at float rounding
  x = np.concatenate([n.logprobs for t in a for n in t.nodes])
  y = np.concatenate([n.logprobs for t in b for n in t.nodes])
  return np.allclose(x, y, atol=1e-3)


def test_rollouts_started_ahead_fill_idle_slots_and_are_adopted(model):
  """`run(ahead=...)` starts the next step's rollouts in slots this run leaves idle, returns when
  its own trees are done, and the next run adopts them: with the same weights every tree equals
  a plain run's (rollouts draw their rng streams from (seed, tree uid, branch)), each run's ledger
  is its own trees' cost, and no page leaks."""
  from trace_jax.allocation.driver import trees_cost

  step1 = [PromptRequest(p, n=3, uid=10 + i) for i, p in enumerate(PROMPTS[:2])]
  step2 = [PromptRequest(p, n=2, uid=20 + i) for i, p in enumerate(PROMPTS)]
  plain = make_engine(model, num_slots=8)
  ref1, ref2 = plain.run(step1), plain.run(step2)

  engine = make_engine(model, num_slots=8)
  free0 = engine.alloc.num_free
  before = engine.ledger.as_dict()
  a1 = engine.run(step1, ahead=step2)
  assert _tree_tokens(a1) == _tree_tokens(ref1) and _same_logprobs(a1, ref1)
  carried = engine.carried
  assert [t.uid for t in carried] == [20, 21, 22]
  # The ahead rollouts used the slots step 1 left idle (8 slots, 6 rollouts of step 1).
  assert engine.ahead_ledger.rollouts_started >= 2
  used = {k: v - before[k] for k, v in engine.ledger.as_dict().items()}
  cost1 = trees_cost(a1)
  assert all(used[k] == cost1[k] for k in cost1), (used, cost1)
  with pytest.raises(ValueError, match="adopt"):
    engine.run([PromptRequest(PROMPTS[0], n=1)])
  before = engine.ledger.as_dict()
  a2 = engine.run([], adopt=True)
  assert [t.uid for t in a2] == [20, 21, 22] and not engine.carried
  assert _tree_tokens(a2) == _tree_tokens(ref2) and _same_logprobs(a2, ref2)
  used = {k: v - before[k] for k, v in engine.ledger.as_dict().items()}
  cost2 = trees_cost(a2)
  assert all(used[k] == cost2[k] for k in cost2), (used, cost2)
  assert engine.ahead_ledger.as_dict() == {k: 0 for k in used}
  # Idle slot steps split into empty slots and turns that ended inside a multi-step call.
  led = engine.ledger
  assert 0 < led.empty_slot_steps <= led.total_slot_steps - led.busy_slot_steps
  engine.release(a1 + a2)
  assert engine.alloc.num_free == free0 and not engine.alloc.refcount.any()


def test_weights_swapped_under_carried_rollouts_and_dropped_ones_free_their_pages(model):
  """Carried rollouts continue under new weights: the tokens generated before the swap are
  counted as stale (`meta["stale_tokens"]`), the ones after it are the new weights' (so the
  trees differ from a plain run's). Dropping carried trees frees every page and keeps their
  cost in the ledger."""
  step1 = [PromptRequest(PROMPTS[0], n=2, uid=1)]
  step2 = [PromptRequest(p, n=3, uid=30 + i) for i, p in enumerate(PROMPTS)]
  engine = make_engine(model, num_slots=8)
  free0 = engine.alloc.num_free
  t1 = engine.run(step1, ahead=step2)
  generated = engine.ahead_ledger.generated_tokens
  assert generated > 0
  engine.update_params(jax.tree.map(lambda x: x * 0.9, model[1]))
  stale = sum(t.meta["stale_tokens"] for t in engine.carried)
  assert stale == generated
  t2 = engine.run([], adopt=True)
  assert all(t.meta["stale_tokens"] <= sum(len(n.gen_ids) for n in t.nodes) for t in t2)
  assert sum(len(t.leaves()) for t in t2) == 9
  engine.release(t1 + t2)
  assert engine.alloc.num_free == free0

  engine = make_engine(model, num_slots=8)
  t1 = engine.run(step1, ahead=step2)
  spent = engine.ahead_ledger.generated_tokens
  before = engine.ledger.generated_tokens
  engine.drop_carried()
  assert engine.ledger.generated_tokens == before + spent and not engine.carried
  engine.release(t1)
  assert engine.alloc.num_free == free0 and not engine.alloc.refcount.any()
