"""`ProcessShardedEngine` within one process: the engine's API and results, unchanged.

(Two processes: `tests/test_multiprocess_train.py`.) With one process every request is this
process's, every gather returns its own data, and the wrapper must give what the engine gives:
the same trees with the same uids (rng streams), forks on the returned trees, the same ledger,
every page freed by `release`, and weights copied through `update_params` unchanged.
"""

import pickle

import jax
import numpy as np
from flax import nnx

from test_sampler import PROMPTS, leaf_sequences, make_engine, model  # noqa: F401 (fixture)
from trace_jax.parallel import allgather_object, local_mesh, make_mesh
from trace_jax.sampling.multiprocess import ProcessShardedEngine
from trace_jax.sampling.engine import ForkRequest, PromptRequest


def _two_stage(engine):
  engine.set_uid_base(100)
  trees = engine.run([PromptRequest(p, n=2) for p in PROMPTS])
  forks = [ForkRequest(t, a.id, 2) for t in trees for a in t.anchors() if a.depth in (0, 1)]
  again = engine.run(forks)
  return trees, again


def test_one_process_wrapper_equals_the_engine(model):  # noqa: F811
  mesh = make_mesh("data:1", devices=jax.devices()[:1])
  assert allgather_object({"a": 1}) == [{"a": 1}] and local_mesh(mesh) is mesh
  plain = make_engine(model)
  inner = make_engine(model)
  wrapped = ProcessShardedEngine(inner, mesh)
  free0 = inner.alloc.num_free
  a, a2 = _two_stage(plain)
  b, b2 = _two_stage(wrapped)
  assert [t.uid for t in b] == [t.uid for t in a] == [100, 101, 102]
  assert [t.uid for t in b2] == [t.uid for t in a2]  # distinct trees, in order of first request
  assert all(x is y for x, y in zip(b2, b))  # forks grew the returned trees in place
  assert leaf_sequences(b) == leaf_sequences(a)
  assert wrapped.ledger.as_dict() == plain.ledger.as_dict()
  np.testing.assert_allclose(wrapped.prompt_features(PROMPTS), plain.prompt_features(PROMPTS))
  # A tree is plain data: it travels to another process without the engine's record of its KV
  # pages, which stays with its owner's engine.
  c = pickle.loads(pickle.dumps(b[0]))
  assert set(vars(c)) == {"uid", "meta", "nodes"} and len(c.nodes) == len(b[0].nodes)
  assert inner.tree_state(b[0]).page_refs and wrapped.tree_state(b[0]).kv
  wrapped.release(b)
  assert inner.alloc.num_free == free0 and not inner.alloc.refcount.any()
  # Weights from the (here one-device) global mesh come back unchanged in the sampling layout.
  wrapped.update_params(model[1])
  same = jax.tree.map(lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))),
                      nnx.state(nnx.merge(model[0], inner.state)), nnx.state(nnx.merge(*model)))
  assert all(jax.tree.leaves(same))
