"""Fault injection for the tests and the chaos benchmark, through the hooks a user has
(`trace_jax.train.Hooks`): a retriever that fails, an environment that stalls, a NaN loss.

As a script it is `launch/train.py` with three more flags:

  python tests/faults.py --config=configs/mhqa.py:smoke ... \\
      --nan_steps=2,3              # those RL steps' updates get a NaN loss (the guard must skip)
      --stall=PROCESS:SECONDS      # that process's first environment step stalls SECONDS
      --retriever_errors=PROCESS:COUNT  # that process's first COUNT searches fail
      --sigterm_step=2             # the process signals itself SIGTERM while packing that step's
                                   # update (a preemption at a chosen step)
"""

from __future__ import annotations

import os
import time

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


class FailingRetriever:
  """A retriever whose first `count` searches raise `RetrieverError` (a tool that fails on one
  host after its retries); otherwise the wrapped retriever."""

  def __init__(self, retriever, count: int):
    self.retriever, self.left = retriever, count

  def search(self, queries, k):
    from trace_jax.envs.retrieval.http_client import RetrieverError
    if self.left > 0:
      self.left -= 1
      print(f"[trace_jax] injected retriever error ({self.left} more to come)", flush=True)
      raise RetrieverError("injected retriever error")
    return self.retriever.search(queries, k)

  def __getattr__(self, name):
    return getattr(self.__dict__["retriever"], name)


class StallOnce:
  """An environment whose first step stalls `seconds` (a hung tool call on one host); otherwise
  the wrapped environment."""

  def __init__(self, env, seconds: float):
    self.env, self.seconds, self.stalled = env, seconds, False

  def step_batch(self, states, texts):
    if not self.stalled:
      self.stalled = True
      print(f"[trace_jax] injected stall: the environment step waits {self.seconds:g}s",
            flush=True)
      time.sleep(self.seconds)
    return self.env.step_batch(states, texts)

  def __getattr__(self, name):
    return getattr(self.__dict__["env"], name)


def process_fault(spec: str, flag: str, process_index: int):
  """The value of a "PROCESS:VALUE" fault for process `process_index`, or None (no fault, or
  another process's)."""
  spec = str(spec or "")
  if not spec:
    return None
  proc, sep, value = spec.partition(":")
  try:
    if not sep or int(proc) < 0 or float(value) < 0:
      raise ValueError
  except ValueError:
    raise ValueError(f"--{flag}={spec!r}: expected PROCESS:VALUE, e.g. 1:30") from None
  return value if int(proc) == process_index else None


def parse_steps(spec: str) -> frozenset:
  """'2,5' -> {2, 5}: the RL steps of --nan_steps."""
  try:
    return frozenset(int(x) for x in str(spec).split(",") if x.strip())
  except ValueError:
    raise ValueError(f"--nan_steps={spec!r}: expected comma-separated step numbers") from None


def fault_hooks(nan_steps: str = "", stall: str = "", retriever_errors: str = "",
                sigterm_step: int = -1):
  """`trace_jax.train.Hooks` injecting the given faults (empty strings, -1: none)."""
  import signal

  import jax
  import jax.numpy as jnp

  from trace_jax.train import Hooks

  steps = parse_steps(nan_steps)
  process_fault(retriever_errors, "retriever_errors", 0)  # malformed specs fail here, at once
  process_fault(stall, "stall", 0)

  # The hooks run inside `build`, after the processes joined: only then is the index known.
  def fail_searches(retriever):
    count = process_fault(retriever_errors, "retriever_errors", jax.process_index())
    return FailingRetriever(retriever, int(count)) if count is not None else retriever

  def stall_once(env):
    seconds = process_fault(stall, "stall", jax.process_index())
    return StallOnce(env, float(seconds)) if seconds is not None else env

  def poison(step, batch):
    if step == sigterm_step:
      print(f"[trace_jax] injected SIGTERM at RL step {step}", flush=True)
      os.kill(os.getpid(), signal.SIGTERM)
    return dict(batch, adv=batch["adv"] * jnp.float32(jnp.nan)) if step in steps else batch

  return Hooks(retriever=fail_searches if retriever_errors else None,
               env=stall_once if stall else None,
               batch=poison if steps or sigterm_step >= 0 else None)


def _main():
  from absl import app, flags

  from launch import train as launch_train  # launch/train.py (its flags)

  nan = flags.DEFINE_string("nan_steps", "", "RL steps whose update gets a NaN loss, e.g. 2,3")
  stall = flags.DEFINE_string("stall", "", "PROCESS:SECONDS: that process's first env step stalls")
  errors = flags.DEFINE_string("retriever_errors", "",
                               "PROCESS:COUNT: that process's first COUNT searches fail")
  sigterm = flags.DEFINE_integer("sigterm_step", -1, "RL step at whose update the process "
                                 "signals itself SIGTERM (-1: never)")

  def main(argv):
    launch_train.main(argv, fault_hooks(nan.value, stall.value, errors.value, sigterm.value))

  app.run(main)


if __name__ == "__main__":
  _main()
