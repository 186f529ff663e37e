"""The many-lessons world (`trace_jax.envs.worlds.lessons_world`): its guarantees, its expert, its
file format, its config, and a smoke run of two methods on it."""

import collections
import dataclasses
import json
import os
import sys

import numpy as np
import pytest

from trace_jax.envs.worlds.lessons_world import LessonsWorldConfig, generate_lessons_world
from trace_jax.envs.worlds.synthetic import World, build_tokenizer, expert_trace, oracle_world
from trace_jax.envs.worlds.synthetic_traces import read_fact
from trace_jax.provenance import world_fingerprint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(n_entities=400, n_relations=12, n_train=600, n_test=120)


@pytest.fixture(scope="module")
def world():
  return generate_lessons_world(LessonsWorldConfig(seed=3, **SMALL))


def test_deterministic_in_seed_and_round_trips(world, tmp_path):
  again = generate_lessons_world(LessonsWorldConfig(seed=3, **SMALL))
  assert world_fingerprint(again) == world_fingerprint(world)
  assert world_fingerprint(generate_lessons_world(LessonsWorldConfig(seed=4, **SMALL))) != \
      world_fingerprint(world)
  world.save(str(tmp_path))
  loaded = World.load(str(tmp_path))
  assert world_fingerprint(loaded) == world_fingerprint(world)
  assert loaded.relations == world.relations and loaded.lessons == world.lessons
  assert loaded.config == world.config and loaded.generation == world.generation
  # The loaded world's expert behaves as the generated one's.
  a = [expert_trace(world, e, np.random.default_rng(0)).turns for e in world.train[:20]]
  b = [expert_trace(loaded, e, np.random.default_rng(0)).turns for e in loaded.train[:20]]
  assert a == b


def test_oracle_answers_every_question_and_decoys_mislead(world):
  perfect = oracle_world(world)
  rng = np.random.default_rng(0)
  for split in (world.train, world.test):
    assert all(expert_trace(perfect, e, rng).correct for e in split)
  # Every hop's decoy wordings surface their planted sentence, read as misleading and naming
  # someone other than the true object.
  misled = 0
  for e in world.test[:40]:
    for r, s, o in zip(e.meta["relations"], e.meta["chain"][:-1], e.meta["chain"][1:]):
      for query, _ in world.relations[r].decoys:
        found, _, was_misleading = read_fact(world.search([query.format(x=s)])[0], r, s,
                                             world.relations)
        assert found != o
        misled += was_misleading
  lesson_hops = sum(r in world.lessons for e in world.test[:40] for r in e.meta["relations"])
  assert misled > 0.9 * lesson_hops * (
      world.config.n_wordings - 1)


def test_no_name_ceiling_and_heldout_is_new(world):
  train_names = {x for e in world.train for x in e.meta["chain"]}
  assert all(set(e.meta["chain"]) <= train_names for e in world.test)
  assert not {e.question for e in world.test} & {e.question for e in world.train}
  assert {e.hops for e in world.train} <= {2, 3, 4} and len(world.test) > 50


def test_lessons_are_independent_words(world):
  verbs = collections.Counter()
  plain = [r for r in world.relations if r not in world.lessons]
  assert len(plain) == world.config.n_plain_relations > 0
  for name, rel in world.relations.items():
    if name in plain:  # one verb, no decoy
      own = [rel.query_passage.split()[0]]
      assert not rel.decoys and own[0] in rel.fact
    else:
      lesson = world.lessons[name]
      own = [lesson["fact_verb"], *lesson["decoy_verbs"]]
      assert len(own) == world.config.n_wordings
      assert lesson["fact_verb"] in rel.fact
      assert rel.query_passage.startswith(lesson["fact_verb"])
    assert rel.noun not in own
    verbs.update(own)
  assert max(verbs.values()) == 1  # no verb shared between relations
  # One lesson per question, at any hop.
  positions = collections.Counter()
  for e in world.train:
    at = [i for i, r in enumerate(e.meta["relations"]) if r in world.lessons]
    assert len(at) == 1
    positions[at[0]] += 1
  assert len(positions) >= 3
  nouns = [r.noun for r in world.relations.values()]
  assert len(set(nouns)) == len(nouns)
  # Every word of the world is a single token (names and verbs alike).
  tok = build_tokenizer(world)
  for v in list(verbs)[:10] + [world.train[0].meta["start"]]:
    assert len(tok.encode(v).ids) == 1


def test_frequency_long_tailed_and_expert_rates_followed(world):
  counts = collections.Counter(r for e in world.train for r in e.meta["relations"]
                               if r in world.lessons)
  ranked = sorted(counts.values(), reverse=True)
  assert ranked[0] > 5 * ranked[-1]
  # Held-out questions are spread evenly over the lessons.
  held = collections.Counter(r for e in world.test for r in e.meta["relations"]
                             if r in world.lessons)
  assert set(held.values()) == {world.config.n_test // world.config.n_relations}
  rates = [v["expert_rate"] for v in world.lessons.values()]
  lo, hi = world.config.expert_rate_range
  assert all(lo <= r <= hi for r in rates)
  # The expert's fact-verb share per relation follows its rate (binomial, 4 sigma).
  rng = np.random.default_rng(1)
  used = collections.defaultdict(list)
  for i in rng.integers(len(world.train), size=3000):
    for s in expert_trace(world, world.train[int(i)], rng).meta["searches"]:
      used[s["relation"]].append(s["wording"] == "passage")
  for r, v in used.items():
    if r not in world.lessons:  # a plain relation: its one verb, always
      assert all(v), r
    elif len(v) >= 100:
      p = world.lessons[r]["expert_rate"]
      assert abs(np.mean(v) - p) < 4 * np.sqrt(p * (1 - p) / len(v)) + 0.01, r


@pytest.mark.parametrize("bad,match", [
    (dict(n_relations=0), "n_relations"), (dict(n_relations=40), "n_relations"),
    (dict(n_wordings=1), "n_wordings"), (dict(expert_rate_range=(0.5, 0.2)), "expert_rate"),
    (dict(hop_weights=(0, 0, 0, 0)), "hop_weights"),
])
def test_bad_world_configs_raise(bad, match):
  with pytest.raises(ValueError, match=match):
    generate_lessons_world(dataclasses.replace(LessonsWorldConfig(**SMALL), **bad))


def test_run_config_checks_world_fields():
  from configs import mhqa

  c = mhqa.get_config("lessons")
  assert mhqa.validate(c).world.kind == "lessons"
  for field, value, match in (("kind", "maze", "world.kind"), ("n_wordings", 1, "n_wordings"),
                              ("expert_rate_lo", 0.99, "expert_rate")):
    bad = mhqa.get_config("lessons")
    bad.world[field] = value
    with pytest.raises(ValueError, match=match):
      mhqa.validate(bad)


def test_world_check_world_parts(tmp_path):
  """launch/world_check.py's parts that need no model, on a small lessons world."""
  from test_train_smoke import launch

  out = tmp_path / "wc.json"
  res = launch("world_check.py", "--config=configs/mhqa.py:lessons",
               f"--config.world.cache_dir={tmp_path}/cache", "--parts=oracle,names,lessons",
               f"--out={out}", timeout=300)
  assert res.returncode == 0, res.stdout[-3000:]
  d = json.loads(out.read_text())
  assert d["oracle_em"] == 1.0 and d["heldout_names_seen"] == 1.0
  assert len(d["lessons"]) == 32 and d["n_test"] == 512
  # One lesson per question: the lessons' train questions add up to the train set.
  assert sum(v["train_questions"] for v in d["lessons"].values()) == d["n_train"]


def test_two_methods_train_on_the_lessons_world(tmp_path):
  """The CI smoke of the lessons world: grpo and trace_tree, two steps each, per-lesson EM
  logged with every evaluation."""
  from test_train_smoke import launch, smoke_args

  for method in ("grpo", "trace_tree"):
    args = [a if not a.startswith("--workdir") else f"--workdir={tmp_path}/{method}"
            for a in smoke_args(str(tmp_path), 2)]
    res = launch("train.py", *args, "--config.world.kind=lessons", f"--config.method={method}")
    assert res.returncode == 0, res.stdout[-3000:]
    summary = json.loads((tmp_path / method / "summary.json").read_text())
    assert summary["method"] == method and summary["rollouts"] > 0
    evals = [json.loads(line) for line in open(tmp_path / method / "metrics.jsonl")
             if "eval_em" in line]
    assert evals and all("eval_groups_learned" in r for r in evals)
    assert any(k.startswith("eval_em_group/r") for k in evals[-1])


def test_wording_use_reads_the_policys_queries(world):
  from trace_jax.envs.worlds.lessons_world import wording_rates, wording_use

  r = next(iter(world.lessons))
  fact, decoy = world.lessons[r]["fact_verb"], world.lessons[r]["decoy_verbs"][0]
  texts = [f"<think> x </think> <search> {fact} Kelmor </search>",
           f"<search> {decoy} Kelmor </search>", f"<search> {fact} Zantro </search>",
           "<answer> Kelmor </answer>", "<search> unknownverb Kelmor </search>",
           "<search> </search>", "no action at all"]
  use = wording_use(world, texts)
  assert use[r] == [2, 3] and sum(n for _, n in use.values()) == 3

  class _Node:
    def __init__(self, text):
      self.text = text

  class _Tree:
    nodes = [_Node(None)] + [_Node(t) for t in texts]

  assert wording_rates(world, [_Tree()]) == {r: 2 / 3}


def test_lesson_choice_probs_are_per_lesson_probabilities(tmp_path):
  """The smooth lesson measure (`diagnostics.lesson_choice_probs`, world_check's independence
  part): one probability per lesson the held-out questions
  need, in (0, 1), the same in any batch size (padding never leaks into a row), and read off
  the model (a change to one fact verb's embedding changes that lesson's value)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from configs import mhqa
  from trace_jax import train as T
  from trace_jax.diagnostics import lesson_choice_probs
  from trace_jax.parallel.sharding import set_variable_value, variable_value

  c = mhqa.get_config("smoke")
  c.world.kind = "lessons"
  c.world.cache_dir = str(tmp_path / "cache")
  c.sft.steps, c.sft.num_traces = 3, 64
  c.eval.size, c.rollout.num_pages = 4, 256
  c.workdir = str(tmp_path / "run")
  run = T.build(mhqa.validate(c))
  test = run.assets.world.test[::40][:12]  # held-out questions are grouped by lesson

  def probs(params, chunk=64):
    return lesson_choice_probs(run.graphdef, params, run.assets, test, chunk)

  a, b = probs(run.init_params), probs(run.init_params, chunk=5)
  needed = {r for q in test for r in q.meta["relations"] if r in run.assets.world.lessons}
  assert set(a) == needed and set(b) == needed
  assert all(0.0 < v < 1.0 for v in a.values())
  np.testing.assert_allclose([a[r] for r in sorted(a)], [b[r] for r in sorted(b)], atol=1e-5)
  r = sorted(needed)[0]
  fact = run.assets.encode(" " + run.assets.world.lessons[r]["fact_verb"])[0]
  params = jax.tree.map(jnp.copy, run.init_params)
  emb = params["embed_tokens"]
  emb = emb["embedding"] if isinstance(emb, dict) else emb  # a State or an array
  if isinstance(emb, nnx.Variable):
    set_variable_value(emb, variable_value(emb).at[fact].multiply(8.0))
  else:
    params["embed_tokens"] = emb.at[fact].multiply(8.0)
  changed = probs(params)
  assert abs(changed[r] - a[r]) > 1e-3


def test_discovery_spread_with_and_without_lessons_never_found():
  """world_check's grpo figures (in a process of its own: the launch script defines flags that
  another test's in-process import of a launch script would clash with)."""
  code = """
import json, sys
from launch.world_check import summarize_grpo
def at(found):  # lessons a..e: fact-verb share 1 for those found
  return dict(em=0.1 * len(found), lessons={}, fact_verb={k: float(k in found) for k in "abcde"})
out = summarize_grpo({0: {0: at("a"), 10: at("ab"), 20: at("abc"), 30: at("abcd")}})
print(json.dumps(out))
"""
  import subprocess
  p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                     timeout=120)
  assert p.returncode == 0, p.stderr[-2000:]
  out = json.loads(p.stdout.strip().splitlines()[-1])
  assert out["discovery_steps"] == [10, 20, 30] and out["discovery_iqr_steps"] == 10.0
  # e never found: counted at step 31, the IQR of [10, 20, 30, 31].
  assert out["discovery_never_found"] == 1
  assert out["discovery_iqr_steps_censored"] == float(np.subtract(*np.percentile(
      [10, 20, 30, 31], [75, 25])))


def test_independence_replay_mixes_the_other_questions_rows_in():
  """world_check's `--independence_replay`: the taught rows stay, the replayed ones come from the
  untaught world's questions without the lesson, about the share asked (a process of its own, as
  above)."""
  code = """
import json, sys, types
import numpy as np
import trace_jax.warm_start as A
from launch.world_check import _with_replay
seen = {}
def fake(c, assets, num_traces=None, examples=None):
  seen.update(n=num_traces, examples=[e.meta["relations"] for e in examples], world=assets.world)
  rows = np.full((num_traces, 4), 7, np.int32)
  return [], dict(tokens=rows, positions=rows.copy(), truncated=3)
A.warm_start_data = fake
ex = lambda *r: types.SimpleNamespace(meta=dict(relations=list(r)))
world = types.SimpleNamespace(train=[ex("k", "p"), ex("m"), ex("p", "q"), ex("k")])
taught = dict(tokens=np.arange(12, dtype=np.int32).reshape(3, 4), positions=np.zeros((3, 4),
              np.int32), truncated=1)
out = _with_replay(taught, None, types.SimpleNamespace(world=world), world, "k", 3, 0.5)
taught_rows = sorted(int(r[0]) for r in out["tokens"] if r[0] != 7)
bad = []
for share in (0.0, 1.0):
  try:
    _with_replay(taught, None, None, world, "k", 3, share)
  except ValueError:
    bad.append(share)
print(json.dumps(dict(n=seen["n"], examples=seen["examples"], rows=len(out["tokens"]),
                      pos=len(out["positions"]), taught=taught_rows, truncated=out["truncated"],
                      bad=bad)))
"""
  import subprocess
  p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                     timeout=120)
  assert p.returncode == 0, p.stderr[-2000:]
  out = json.loads(p.stdout.strip().splitlines()[-1])
  assert out["n"] == 3 and out["examples"] == [["m"], ["p", "q"]]  # no question with lesson k
  assert out["rows"] == out["pos"] == 6 and out["taught"] == [0, 4, 8] and out["truncated"] == 1
  assert out["bad"] == [0.0, 1.0]
