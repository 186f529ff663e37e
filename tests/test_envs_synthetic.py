"""The synthetic world: structure, determinism, the planted trap, expert traces, tokenizer."""

import dataclasses
import json
import re
import time

import numpy as np
import pytest

from trace_jax.envs import react
from trace_jax.envs.worlds import synthetic as syn
from trace_jax.envs.tasks.multihop import MultiHopEnv, segments_to_tokens

SMALL = syn.SyntheticWorldConfig(seed=3, n_entities=300, n_train=200, n_test=60)


@pytest.fixture(scope="module")
def small():
  return syn.generate_world(SMALL)


@pytest.fixture(scope="module")
def default_world():
  t0 = time.time()
  world = syn.generate_world(syn.SyntheticWorldConfig(seed=0))
  world.generation_seconds = time.time() - t0
  return world


def _with(world, **changes):
  """The same world with expert settings changed (the corpus and questions are shared)."""
  return dataclasses.replace(world, config=dataclasses.replace(world.config, **changes))


def _no_random_errors(world, trap_rate):
  return _with(world, trap_rate=trap_rate, wrong_entity_rate=0.0, skip_hop_rate=0.0,
               premature_guess_rate=0.0)


def test_default_world_size_and_speed(default_world):
  w = default_world
  assert w.generation_seconds < 20
  assert len(w.corpus) == len(w.entities) == 2000
  assert (len(w.train), len(w.test)) == (4000, 500)
  assert syn.build_tokenizer(w).get_vocab_size() < 5000
  assert {ex.hops for ex in w.test} == {1, 2, 3, 4}


def test_deterministic_in_seed(small):
  again = syn.generate_world(SMALL)
  assert again.corpus == small.corpus and again.train == small.train and again.test == small.test
  other = syn.generate_world(dataclasses.replace(SMALL, seed=4))
  assert other.corpus != small.corpus


def test_names_and_near_duplicates(small):
  names = list(small.entities)
  assert len(set(names)) == len(names)
  assert all(re.fullmatch(r"[A-Z][a-z]+", n) for n in names)
  assert len(small.twins) >= 20
  for a, b in small.twins.items():
    assert small.twins[b] == a and small.entities[a] == small.entities[b]
    assert len(a) == len(b) and sum(x != y for x, y in zip(a.lower(), b.lower())) == 1


def test_questions_follow_the_facts(small):
  docs = {d.id: d for d in small.corpus}
  for ex in small.train + small.test:
    rels, chain = ex.meta["relations"], ex.meta["chain"]
    assert 1 <= ex.hops == len(rels) == len(chain) - 1 <= 4
    assert ex.answers == [chain[-1]] and chain[0] == ex.meta["start"]
    assert ex.question == syn.question_text(chain[0], rels)
    assert len(set(chain)) == len(chain)  # No loops: the answer is never named in the question.
    for r, s, o in zip(rels, chain, chain[1:]):
      assert small.facts[r][s] == o
      needed = docs[small.needed_doc_id(r, s)]
      assert syn.read_fact([needed], r, s)[:1] == (o,)


def test_splits_are_disjoint(small):
  train_starts = {ex.meta["start"] for ex in small.train}
  test_starts = {ex.meta["start"] for ex in small.test}
  assert not train_starts & test_starts
  assert not {ex.question for ex in small.train} & {ex.question for ex in small.test}
  assert len({ex.id for ex in small.train + small.test}) == len(small.train) + len(small.test)


def test_save_load_roundtrip(small, tmp_path):
  small.save(str(tmp_path))
  loaded = syn.World.load(str(tmp_path))
  assert loaded.config == small.config
  assert loaded.corpus == small.corpus and loaded.train == small.train and loaded.test == small.test
  assert loaded.facts == small.facts and loaded.traps == small.traps
  q = [ex.question for ex in small.test[:5]]
  assert loaded.retriever().search(q, 2) == small.retriever().search(q, 2)
  with pytest.raises(FileNotFoundError, match="World.save"):
    syn.World.load(str(tmp_path / "nowhere"))


def test_retriever_follows_config(small):
  r = small.retriever()
  assert small.retriever() is r and (r.k1, r.b) == (small.config.bm25_k1, small.config.bm25_b)
  changed = _with(small, bm25_b=0.75)
  assert changed.retriever().b == 0.75 and small.retriever().b == small.config.bm25_b


def test_config_validation():
  with pytest.raises(ValueError, match="type_fractions"):
    syn.generate_world(dataclasses.replace(SMALL, type_fractions=(0.5, 0.5)))
  with pytest.raises(ValueError, match="trap relations"):
    syn.generate_world(dataclasses.replace(SMALL, trap_relations=("born_in",)))


def test_trap_wording_decides_retrieval(default_world):
  """Question wording on a trap relation misses the needed passage and surfaces a wrong
  candidate; the passage wording finds it. Other relations work with either wording."""
  stats = syn.retrieval_stats(default_world, default_world.test)
  assert stats["trap_question_wording_hit_at_k"] <= 0.05
  assert stats["trap_question_wording_misleading_in_top_k"] >= 0.95
  assert stats["trap_passage_wording_hit_at_k"] >= 0.95
  assert stats["other_question_wording_hit_at_k"] >= 0.98
  assert stats["other_passage_wording_hit_at_k"] >= 0.98
  # One query with the raw question almost never brings every passage of a multi-hop chain.
  for hops, rate in stats["raw_question_all_needed_in_top_k_by_hops"].items():
    if hops >= 2:
      assert rate <= 0.05


def test_bad_search_makes_the_rest_fail(default_world):
  trap_examples = [ex for ex in default_world.test
                   if set(ex.meta["relations"]) & set(default_world.config.trap_relations)]
  assert len(trap_examples) >= 100
  rng = np.random.default_rng(0)
  bad = _no_random_errors(default_world, trap_rate=1.0)
  good = _no_random_errors(default_world, trap_rate=0.0)
  bad_traces = [syn.expert_trace(bad, ex, rng) for ex in trap_examples]
  good_traces = [syn.expert_trace(good, ex, rng) for ex in trap_examples]
  assert np.mean([t.correct for t in bad_traces]) <= 0.05
  assert np.mean([t.correct for t in good_traces]) >= 0.95
  assert np.mean([t.meta["misled"] for t in bad_traces]) >= 0.9


def test_error_free_expert_solves_the_world(small):
  perfect = _no_random_errors(small, trap_rate=0.0)
  rng = np.random.default_rng(0)
  assert np.mean([syn.expert_trace(perfect, ex, rng).correct for ex in small.test]) >= 0.97


def test_longer_chains_are_harder(default_world):
  stats = syn.expert_stats(default_world, default_world.test, 2, seed=0)
  by_hop = stats["success_by_hops"]
  assert by_hop[1] > by_hop[2] > by_hop[3] > by_hop[4]
  assert 0.3 <= stats["success"] <= 0.8
  assert stats["mixed_share_over_2_traces"] >= 0.2  # Prompts differ in difficulty.
  assert stats["trap_success_after_question_wording"] < stats["trap_success_after_passage_wording"]


def test_traces_replay_in_the_env(small):
  env = MultiHopEnv(small.retriever(), "em", max_turns=small.config.max_turns,
                    topk=small.config.topk)
  rng = np.random.default_rng(1)
  for ex in small.test[:40]:
    trace = syn.expert_trace(small, ex, rng)
    assert len(trace.turns) <= small.config.max_turns
    assert all(o is not None for _, o in trace.turns[:-1]) and trace.turns[-1][1] is None
    state = env.reset(ex.answers)
    for generated, observation in trace.turns:
      result = env.step_batch([state], [generated])[0]
      assert result.observation_text == observation
    assert result.done and result.reward == float(trace.correct)
    assert result.info["prediction"] == trace.answer
  assert env.counters["invalid_actions"] == 0


def test_sft_dataset_keeps_both_wordings_and_failures(small):
  records = syn.make_sft_dataset(small, 400, np.random.default_rng(0))
  assert len(records) == 400
  again = syn.make_sft_dataset(small, 400, np.random.default_rng(0))
  assert [r.trace.turns for r in records] == [r.trace.turns for r in again]
  correct = [r.trace.correct for r in records]
  assert 0.2 < np.mean(correct) < 0.9  # Failed traces are kept.
  wordings = [s["wording"] for r in records for s in r.trace.meta["searches"]
              if s["relation"] in small.config.trap_relations]
  share_bad = np.mean([w == "question" for w in wordings])
  assert len(wordings) >= 50 and 0.55 <= share_bad <= 0.85  # The good wording exists, rarer.
  segs = records[0].segments()
  assert segs[0] == (syn.trace_segments(records[0].example, records[0].trace)[0])
  assert not segs[0][1] and segs[1][1] and [g for _, g in segs[1:]] == [
      i % 2 == 0 for i in range(len(segs) - 1)]
  with pytest.raises(ValueError, match="no 'dev' examples"):
    syn.make_sft_dataset(small, 1, np.random.default_rng(0), split="dev")
  subset = small.train[:5]
  picked = syn.make_sft_dataset(small, 50, np.random.default_rng(0), examples=subset)
  assert {r.example.id for r in picked} <= {ex.id for ex in subset}
  with pytest.raises(ValueError, match="no examples"):
    syn.make_sft_dataset(small, 1, np.random.default_rng(0), examples=[])


def test_tokenizer(small):
  tok = syn.build_tokenizer(small)
  vocab = tok.get_vocab()
  assert [vocab[t] for t in ("<pad>", "<bos>", "<eos>", "<unk>")] == [0, 1, 2, 3]
  for tag in react.ALL_TAGS:
    assert tok.encode(f"x{tag}y").tokens[1] == tag or tok.encode(tag).tokens == [tag]
    assert len(tok.encode(tag).ids) == 1
  records = syn.make_sft_dataset(small, 100, np.random.default_rng(2))
  unk = vocab["<unk>"]
  texts = [t for r in records for t, _ in r.segments()] + [d.contents for d in small.corpus]
  assert all(unk not in tok.encode(t).ids for t in texts)
  # Decoding generated ids gives text that parses to the same action.
  for r in records[:20]:
    for generated, _ in r.trace.turns:
      decoded = tok.decode(tok.encode(generated).ids)
      assert react.parse_action(decoded) == react.parse_action(generated)
  hf = syn.build_hf_tokenizer(small)
  assert hf.pad_token_id == 0 and hf.eos_token_id == 2 and hf.unk_token_id == 3
  sample = records[0].trace.turns[0][0]
  assert hf(sample, add_special_tokens=False).input_ids == tok.encode(sample).ids


def test_sequence_budget(default_world):
  tok = syn.build_tokenizer(default_world)
  records = syn.make_sft_dataset(default_world, 300, np.random.default_rng(0))
  close = tok.encode("</information>").ids
  lengths, obs = [], []
  for r in records:
    ids, mask = segments_to_tokens(r.segments(), lambda s: tok.encode(s).ids)
    lengths.append(len(ids))
    assert mask.any() and not mask[0]
    for text, generated in r.segments()[1:]:
      if not generated:
        o = tok.encode(text).ids
        obs.append(len(o))
        assert o[-len(close):] == close
  assert max(lengths) < 384 and max(obs) <= 72 and np.mean(obs) <= 56


def test_stats_cli(capsys):
  syn.main(["--seed", "1", "--n_entities", "300", "--n_train", "200", "--n_test", "50",
            "--stats"])
  stats = json.loads(capsys.readouterr().out)
  assert stats["entities"] == 300 and stats["passages"] == 300
  assert (stats["train_questions"], stats["test_questions"]) == (200, 50)
  assert set(stats["expert_test"]["success_by_hops"]) <= {"1", "2", "3", "4"}
  assert stats["generation_seconds"] < 20


def test_holdout_test_facts():
  world = syn.generate_world(dataclasses.replace(SMALL, holdout_test_facts=True))
  test_facts = {f for ex in world.test for f in zip(ex.meta["relations"], ex.meta["chain"])}
  train_facts = {f for ex in world.train for f in zip(ex.meta["relations"], ex.meta["chain"])}
  assert world.test and world.train and not test_facts & train_facts
  assert syn.world_stats(world, traces_per_example=1)["test_facts_seen_in_train_chains"] == 0.0
