"""Connects the sampler's env callback to `MultiHopEnv`, reconstructing each rollout's env state
from its tree path, so forks from any anchor continue with the right turn count and format flags."""

from __future__ import annotations

from trace_jax.envs.env import EnvState, MultiHopEnv
from trace_jax.envs.react import parse_action


def make_env_step(env: MultiHopEnv):
  """env_step([(TurnRef, generated_text)]) -> [(observation_text | None, done, reward)].

  The tree's `meta["answers"]` holds the gold answers. A rollout cut by a sampler limit never
  reaches the environment (the sampler records it with the truncation reward).
  """
  def env_step(items):
    states = []
    for ref, _ in items:
      tree, node = ref.tree, ref.node
      before = tree.path(node.parent)[1:]  # earlier turns of this rollout
      n_invalid = sum(parse_action(tree.nodes[i].text).kind == "invalid" for i in before)
      states.append(EnvState(golds=list(tree.meta["answers"]),
                             example_id=str(tree.meta.get("id", "")), turn=len(before),
                             n_invalid=n_invalid))
    results = env.step_batch(states, [text for _, text in items])
    return [(r.observation_text, r.done, r.reward) for r in results]
  return env_step
