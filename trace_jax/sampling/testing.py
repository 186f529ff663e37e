"""Stand-ins for the sampler's pluggable parts (tokenizer, environment) and an oracle check.

Used by the sampler tests and benchmarks so they do not depend on the real environment: a word
tokenizer over ids ("w17"), a deterministic environment whose observations depend on the turn text,
and a long-tailed simulated workload for the scheduler benchmark.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class IdTokenizer:
  """Token i <-> word "w{i}"; a few ids decode to action tags so stop strings can fire."""

  def __init__(self, special: dict[int, str] | None = None):
    self.special = dict(special or {})
    self.inverse = {v: k for k, v in self.special.items()}

  def decode(self, ids) -> str:
    return " ".join(self.special.get(int(i), f"w{int(i)}") for i in ids)

  def encode(self, text: str) -> list[int]:
    return [self.inverse[w] if w in self.inverse else int(w[1:]) for w in text.split()]


class ScriptedEnv:
  """Deterministic environment: an answer tag ends the rollout (reward from the text), so does
  reaching `max_depth`; otherwise the observation has 3 + obs_growth * depth words that depend on
  the turn text, so sibling branches with different turns see different observations."""

  def __init__(self, vocab: int, max_depth: int = 3, obs_growth: int = 5, first_id: int = 8):
    self.vocab, self.max_depth, self.obs_growth = vocab, max_depth, obs_growth
    self.first_id = first_id
    self.calls = 0

  def __call__(self, calls):
    out = []
    for ref, text in calls:
      self.calls += 1
      d = ref.node.depth
      h = sum(ref.node.gen_ids) + 7 * d
      if "</answer>" in text or d >= self.max_depth:
        out.append((None, True, float(h % 2)))
      else:
        span = self.vocab - self.first_id
        words = [f"w{self.first_id + (h + 3 * k) % span}" for k in range(3 + self.obs_growth * d)]
        out.append((" ".join(words), False, 0.0))
    return out


class LongTailEnv:
  """Simulated long-tailed workload: each rollout's number of turns is Pareto distributed (most
  rollouts short, a few long), observations are a few random words. Everything is a function of
  (seed, tree uid, rollout index, depth), so results do not depend on scheduling order. Turn
  lengths come from the engine's `turn_limit_fn` (see the scheduler tests and the benchmark)."""

  def __init__(self, vocab: int, seed: int = 0, mean_turns: float = 1.5, max_turns: int = 8,
               obs_words: int = 4, shape: float = 1.5):
    self.vocab, self.seed, self.mean_turns, self.max_turns = vocab, seed, mean_turns, max_turns
    self.obs_words, self.shape = obs_words, shape

  def num_turns(self, tree_uid: int, rollout: int) -> int:
    rng = np.random.default_rng([self.seed, tree_uid, rollout])
    return int(min(self.max_turns, 1 + rng.pareto(self.shape) * self.mean_turns))

  def __call__(self, calls):
    out = []
    for ref, _ in calls:
      node = ref.node
      rng = np.random.default_rng([self.seed, ref.tree.uid, node.rollout, node.depth, 1])
      if node.depth >= self.num_turns(ref.tree.uid, node.rollout):
        out.append((None, True, float(rng.random() < 0.5)))
      else:
        words = rng.integers(8, self.vocab, self.obs_words)
        out.append((" ".join(f"w{int(x)}" for x in words), False, 0.0))
    return out


def make_forward(graphdef):
  """Jitted plain full-sequence forward: (state, tokens i32[1, T]) -> (logits, hidden)."""

  @jax.jit
  def fwd(state, tokens):
    out = nnx.merge(graphdef, state).forward(tokens)
    return out["logits"][0], out["hidden"][0]

  return fwd


def check_against_forward(trees, graphdef, state, greedy: bool, atol: float = 2e-4) -> dict:
  """Replays every leaf's full token sequence through `model.forward` and compares.

  Checks, at every generated position, the greedy argmax (if greedy) and the recorded logprob, and
  for every node with a feature the hidden state at the node's last token. Returns counts; raises
  AssertionError on the first mismatch.
  """
  fwd = make_forward(graphdef)
  stats = {"tokens": 0, "features": 0}
  for tree in trees:
    seen = set()
    for node in tree.nodes:
      if node.children:
        continue
      ids, mask, owner, lps = tree.path_tokens(node.id)
      if len(ids) < 2:
        continue
      logits, hidden = jax.device_get(fwd(state, jnp.asarray(ids)[None]))
      logp = jax.nn.log_softmax(logits, axis=-1)
      for t in np.nonzero(mask)[0]:
        if greedy:
          assert int(np.argmax(logits[t - 1])) == ids[t], (tree.uid, node.id, t)
        np.testing.assert_allclose(lps[t], logp[t - 1, ids[t]], atol=atol, rtol=0)
        stats["tokens"] += 1
      for nid in tree.path(node.id):
        n = tree.nodes[nid]
        if n.feature is not None and nid not in seen:
          end = tree.prefix_len(nid) - 1
          np.testing.assert_allclose(n.feature, hidden[end], atol=atol, rtol=1e-3)
          stats["features"] += 1
        seen.add(nid)
  return stats


__all__ = ["IdTokenizer", "LongTailEnv", "ScriptedEnv", "check_against_forward", "make_forward"]
