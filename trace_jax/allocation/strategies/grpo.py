"""GRPO: every prompt of the step gets an equal share of the whole budget; no stage 2."""

from trace_jax.allocation.strategies.base import Strategy, register


@register
class Grpo(Strategy):
  """The base class's defaults are GRPO's; trains with GRPO's advantage (a tree's leaves are
  its group)."""
  name = "grpo"
  advantage = "grpo"
