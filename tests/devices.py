"""Runs a test script in a fresh interpreter on N simulated CPU devices (the device count is fixed
when jax starts, so a multi-device check cannot share the test process) and reads the JSON line it
prints last."""

import json
import os
import subprocess
import sys

from conftest import xla_flags

TESTS = os.path.dirname(os.path.abspath(__file__))
# A script imports the tests' helpers (test_batch, test_tree_attention): tests/ is on its path.
SCRIPTS = os.path.join(TESTS, "scripts")


def device_env(devices: int = 8, **extra) -> dict:
  """The environment of a process with `devices` CPU devices."""
  return dict(os.environ, XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu",
              PYTHONPATH=os.pathsep.join([TESTS, os.path.dirname(TESTS)]), **extra)


def last_json(out: str) -> dict:
  lines = [line for line in out.splitlines() if line.startswith("{")]
  assert lines, out[-3000:]
  return json.loads(lines[-1])


def run_on_devices(script: str, *args, devices: int = 8, timeout: int = 600) -> dict:
  """`python tests/scripts/<script> args...` on `devices` CPU devices; asserts a zero exit and
  returns the last JSON line of its stdout."""
  r = subprocess.run([sys.executable, os.path.join(SCRIPTS, script), *map(str, args)],
                     env=device_env(devices), capture_output=True, text=True, timeout=timeout)
  assert r.returncode == 0, (r.stdout[-2000:] + r.stderr[-3000:])
  return last_json(r.stdout)
