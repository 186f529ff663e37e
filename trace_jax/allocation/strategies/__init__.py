"""The methods, one module each behind one interface (`base.Strategy`), selected by name.

  name        stage 1 (roots)                          stage 2 (anchors)                 advantage
  ----------  ---------------------------------------  --------------------------------  ----------
  trace       p̂ over a candidate pool (predicted.py)   Σ 1 - q_h^k per cost (trace.py)   configured
  trace_tree  p̂ over a candidate pool                  chance each tree mixes (trace.py) configured
  root_only   p̂ over a candidate pool                  spread evenly (root_only.py)      configured
  grpo        the whole budget evenly (base.py)        none                              grpo
  dapo        oversampled, all-equal groups dropped    none                              grpo
  tree_grpo   root_budget evenly                       random nodes of every tree        tree_grpo
  arpo        root_budget evenly                       where entropy rises after a tool  grpo

A new method is one module: subclass `Strategy`, decorate it with `@register`, and import the
module (here, or from your own code before the run is built); `--config.method=<name>` selects it.
"""

from trace_jax.allocation.strategies.base import (PrefixBudget, RootPlan, Strategy, advantage_for,
                                                  get, names, register, unregister)
# Importing the method modules registers them, in this order (the order `names()` lists them).
from trace_jax.allocation.strategies import trace, root_only, grpo, dapo, tree_grpo, arpo  # noqa: E402,F401,I001

__all__ = ["PrefixBudget", "RootPlan", "Strategy", "advantage_for", "get", "names", "register",
           "unregister"]
