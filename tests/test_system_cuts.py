"""A leaf the system ended (the KV pool ran out, a tool failed its retries) is no outcome of the
policy's: it is counted and left out of values, advantages, predictor targets and training."""

import json

import pytest
from test_env_interface import Echo, WordTokenizer
from test_sampler import PROMPTS, make_engine, model  # noqa: F401  (model: the module fixture)

from trace_jax.envs.interface import FunctionEnv, StepResult
from trace_jax.sampling.engine import PromptRequest
from trace_jax.sampling.tree import (Tree, is_system_cut, system_cut_leaves,
                                     without_system_cuts)


def _tree():
  """root -> a -> {ok (1.0), cut by the pool}; root -> b -> cut by a failed tool."""
  t = Tree([1, 2, 3], uid=5, meta={"id": "q"})
  a = t.add_node(0, gen_ids=[4], logprobs=[-0.1])
  t.add_node(a.id, gen_ids=[5], logprobs=[-0.2], done=True, reward=1.0)
  t.add_node(a.id, gen_ids=[6], done=True, truncated="pool_exhausted", reward=0.0)
  b = t.add_node(0, gen_ids=[7])
  t.add_node(b.id, gen_ids=[8], done=True, truncated="system:retries_failed", reward=0.0)
  t.add_node(b.id, gen_ids=[9], done=True, truncated="max_turns", reward=0.0)  # the policy's
  return t


def test_system_cut_leaves_and_the_nodes_only_they_reach_leave_the_tree():
  t = _tree()
  assert system_cut_leaves([t]) == 2
  p = without_system_cuts(t)
  assert p is not t and p.uid == t.uid and p.meta == t.meta
  assert [n.gen_ids for n in p.nodes] == [[], [4], [5], [7], [9]]  # the cut leaves gone
  assert [n.parent for n in p.nodes] == [-1, 0, 1, 0, 3]
  assert [n.children for n in p.nodes] == [[1, 3], [2], [], [4], []]
  assert system_cut_leaves([p]) == 0 and not any(is_system_cut(n) for n in p.nodes)
  p.backup()
  assert p.root.value == pytest.approx(0.5) and p.root.n_leaves == 2  # the policy's outcomes
  t.backup()
  assert t.root.n_leaves == 4  # the cut ones counted as failures before
  whole = Tree([1], uid=1)
  whole.add_node(0, gen_ids=[2], done=True, reward=1.0)
  assert without_system_cuts(whole) is whole  # nothing to remove: the same tree
  lost = Tree([1], uid=2)
  lost.add_node(0, gen_ids=[2], done=True, truncated="pool_exhausted", reward=0.0)
  assert without_system_cuts(lost) is None


def test_leaves_cut_by_the_pool_leave_the_trees_the_update_reads(model):  # noqa: F811
  # Pages held outside the engine leave less than a rollout: the pool cuts (its last resort;
  # a pool merely below the need preempts instead, tests/test_sampler_preemption.py).
  engine = make_engine(model)
  engine.alloc.alloc(engine.alloc.num_free - 8)
  small = engine.run([PromptRequest(p, n=2) for p in PROMPTS[:2]])
  cut = system_cut_leaves(small)
  assert cut > 0, "the pool was meant to run out"
  kept = [x for x in (without_system_cuts(t) for t in small) if x is not None]
  assert system_cut_leaves(kept) == 0
  assert sum(len(t.leaves()) for t in kept) == sum(len(t.leaves()) for t in small) - cut
  for t, s in zip(kept, small):  # what is kept is exactly the uncut root-to-leaf paths
    assert ({tuple(t.path_tokens(x.id)[0]) for x in t.leaves()}
            == {tuple(s.path_tokens(x.id)[0]) for x in s.leaves() if not is_system_cut(x)})


class FlakyTool(Echo):
  """Echo whose tool fails for good (after its retries) on every third call: the rollout ends,
  and the environment says the system ended it."""

  def step(self, state, text):
    if (self.calls + 1) % 3 == 0 and "<answer>" not in text:
      self.calls += 1
      return StepResult(None, True, 0.0, {"system_cut": "retries_failed"})
    return super().step(state, text)


def test_a_run_counts_system_cut_leaves_and_trains_none(tmp_path):
  from test_train_smoke import smoke_args

  from configs import mhqa
  from trace_jax import train as T
  from trace_jax.assets import Assets

  words = ["<call>", "</call>", "<answer>", "</answer>", "<obs>", "</obs>", "find"] + [
      str(i) for i in range(10)]
  tok = WordTokenizer(words)
  env = FunctionEnv(FlakyTool(), stop_strings=("</call>", "</answer>"),
                    observation_close="</obs>", max_turns=2)

  def example(i):
    return dict(id=f"toy-{i}", question=f"find {i}", answers=[str(i)], target=str(i),
                prompt_ids=[tok.ids["<bos>"]] + tok.encode(f"find {i}"))

  assets = Assets(encode=tok.encode, decode=tok.decode, bos_id=1, eos_id=2,
                  vocab_size=len(tok.vocab), train=[example(i) for i in range(10)],
                  test=[example(i) for i in range(4)], env=env)
  c = mhqa.get_config("smoke")
  for arg in smoke_args(str(tmp_path), 2)[1:]:
    key, value = arg[2:].split("=", 1)
    if key != "workdir":
      sec, field = key.split(".")[1:]
      c[sec][field] = type(c[sec][field])(value)
  c.method, c.workdir, c.env.max_turns = "trace_tree", str(tmp_path / "run"), 2
  T.train(mhqa.validate(c), assets=assets)
  steps = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  steps = [r for r in steps if "system_cut_leaves" in r]
  assert len(steps) == 2
  assert sum(r["system_cut_leaves"] for r in steps) > 0
  assert all(r["system_cut_trained"] == 0 for r in steps)
