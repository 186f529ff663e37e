"""Why a synthetic-world rollout failed (`diagnostics.classify_failure`), on hand-made trees."""

import os
import types

import pytest

from trace_jax.diagnostics import (FAILURE_KINDS, classify_failure, failure_breakdown,
                                   trap_allocation)
from trace_jax.sampling.tree import Tree

# A 2-hop question: Zantro --founded_by--> Kelmor --born_in--> Ostra. founded_by is a trap whose
# fact sits in the object's passage (Kelmor's); Brisk and Velm carry the misleading sentence.
WORLD = types.SimpleNamespace(traps={"founded_by|Zantro": ["Brisk", "Velm"]},
                              needed_doc_id=lambda rel, subj: "Kelmor")
META = {"meta": {"relations": ["founded_by", "born_in"], "chain": ["Zantro", "Kelmor", "Ostra"],
                 "needed_doc_ids": ["Kelmor", "Kelmor2"]}}


def obs(*titles, query="founder of Zantro"):
  """An observation showing these passages, after a search with `query`."""
  return ("<information> " + " ".join(f"(Title : {t} ) text ." for t in titles)
          + " </information>", query)


def tree_with(leaves):
  """One tree whose root has a child per leaf spec (list of observation texts, answer, reward)."""
  t = Tree([1, 2, 3], uid=0, meta=META)
  for observations, answer, reward in leaves:
    parent = 0
    for o, q in observations:
      parent = t.add_node(parent, text=f"<think> x </think> <search> {q} </search>", obs_text=o).id
    t.add_node(parent, text=f"<answer> {answer} </answer>" if answer else "<search> q",
               done=True, reward=reward)
  return t


@pytest.mark.parametrize("observations,answer,reward,kind", [
    ([obs("Kelmor"), obs("Kelmor2")], "Ostra", 1.0, None),
    ([obs("Kelmor"), obs("Kelmor2")], None, 0.0, "no_answer"),
    ([obs("Brisk"), obs("Kelmor", "Kelmor2")], "Nowhere", 0.0, "misled"),  # misleading first
    ([obs("Brisk", "Kelmor"), obs("Kelmor2")], "Nowhere", 0.0, "wrong_answer"),  # both at once
    # hop 2's passage never showed: its subject (Kelmor) named in no query, or named in vain
    ([obs("Kelmor"), obs("Other", query="birthplace of Kelmoro")], "X", 0.0, "wrong_entity"),
    ([obs("Kelmor")], "X", 0.0, "wrong_entity"),  # answered after one hop of two
    ([obs("Kelmor"), obs("Other", query="birthplace of Kelmor")], "X", 0.0, "search_missed"),
    ([obs("Other", query="founder of Zantro")], "X", 0.0, "search_missed"),  # hop 1 named
    ([obs("Other", query="founder of Zontra")], "X", 0.0, "wrong_entity"),
    ([obs("Kelmor"), obs("Kelmor2")], "Nowhere", 0.0, "wrong_answer"),
])
def test_classify_failure(observations, answer, reward, kind):
  t = tree_with([(observations, answer, reward)])
  assert classify_failure(t, t.leaves()[0].id, WORLD) == kind


def test_failure_breakdown_counts_every_leaf_once():
  t = tree_with([([obs("Kelmor"), obs("Kelmor2")], "Ostra", 1.0),
                 ([obs("Brisk")], "X", 0.0), ([obs("Kelmor")], "X", 0.0),
                 ([obs("Kelmor"), obs("Kelmor2")], "X", 0.0)])
  out = failure_breakdown([t], WORLD)
  assert out["rollouts"] == 4
  assert out["success"] == out["misled"] == out["wrong_entity"] == out["wrong_answer"] == 0.25
  assert out["no_answer"] == out["search_missed"] == 0.0
  assert sum(out[k] for k in ("success", *FAILURE_KINDS)) == pytest.approx(1.0)


def test_trap_allocation_splits_the_step_by_trap_hop():
  """Two of four pool prompts have a trap hop; the step sampled one trap tree (two failed
  rollouts) and one other tree (one success, one failure)."""
  other = {"meta": {"relations": ["born_in", "born_in"], "chain": ["Kelmor", "Ostra", "Vey"]}}
  pool = [META, META, other, other]
  trap = tree_with([([obs("Brisk")], "X", 0.0), ([obs("Brisk")], "Y", 0.0)])
  plain = Tree([1, 2, 3], uid=1, meta=other)
  plain.add_node(0, text="<answer> Vey </answer>", done=True, reward=1.0)
  plain.add_node(0, text="<answer> Ostra </answer>", done=True, reward=0.0)
  out = trap_allocation(pool, [trap, plain], WORLD)
  assert out["pool_trap_share"] == 0.5 and out["sampled_trap_share"] == 0.5
  assert out["rollouts_trap_share"] == 0.5
  assert out["reward_trap"] == 0.0 and out["mixed_share_trap"] == 0.0
  assert out["reward_other"] == 0.5 and out["mixed_share_other"] == 1.0
  assert trap_allocation(pool, [], WORLD) == {"pool_trap_share": 0.5}
  # The training loop logs it through the data source, which knows whether it has a world.
  from trace_jax.assets import Assets
  kw = dict(encode=None, decode=None, bos_id=None, eos_id=None, vocab_size=1, train=[], test=[],
            retriever=None)
  assert Assets(world=WORLD, **kw).step_diagnostics(pool, [trap, plain]) == out
  assert Assets(**kw).step_diagnostics(pool, [trap, plain]) == {}  # real data: nothing


_CACHED_JIT = """
import os, sys
import jax, jax.numpy as jnp
from trace_jax.diagnostics import CompileCounter
from trace_jax.train import use_compile_cache
used = use_compile_cache(sys.argv[1], min_compile_s=0.0)
with CompileCounter() as cc:
  y = jax.jit(lambda x: jnp.tanh(x) @ x.T + 1.5)(jnp.ones((8, 8)))
print(used == os.path.abspath(sys.argv[1]), cc.n, float(y[0, 0]))
"""


def test_compile_cache_lets_a_second_process_skip_compiling(tmp_path, monkeypatch):
  """`train.use_compile_cache` (launch/train.py's --compile_cache): the first process compiles
  and stores the program, a second one with the same directory loads it (no backend compile,
  same result); an empty path or JAX_COMPILATION_CACHE_DIR leaves the cache alone."""
  import subprocess
  import sys
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env["JAX_PLATFORMS"] = "cpu"
  cache = str(tmp_path / "xla")
  run = lambda: subprocess.run([sys.executable, "-c", _CACHED_JIT, cache], env=env,  # noqa: E731
                               capture_output=True, text=True, timeout=120,
                               cwd=os.path.join(os.path.dirname(__file__), ".."))
  first, second = run(), run()
  assert first.returncode == 0 == second.returncode, first.stderr[-2000:] + second.stderr[-2000:]
  used1, n1, y1 = first.stdout.split()
  used2, n2, y2 = second.stdout.split()
  assert used1 == used2 == "True" and int(n1) >= 1 and int(n2) == 0 and y1 == y2
  assert os.listdir(cache)
  from trace_jax.train import use_compile_cache
  assert use_compile_cache("") is None
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
  assert use_compile_cache(str(tmp_path / "other")) is None and not (tmp_path / "other").exists()
