"""Measures Qwen3 parity against `transformers` on the parity tests' random tiny models.

  python benchmarks/parity_report.py      # needs torch (the test extra); writes
                                          # results/qwen3_parity.json

The tests assert a 1e-4 bound; this records the actual largest differences they allow through.
"""

import json
import os
import pathlib
import platform
import tempfile

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def main():
  import jax.numpy as jnp
  import numpy as np
  import torch
  from test_qwen3_parity import CONFIGS, _hf_model  # the exact models the tests check

  from trace_jax.models.qwen3 import from_pretrained

  rows = {}
  for name in sorted(CONFIGS):
    m, path = _hf_model(pathlib.Path(tempfile.mkdtemp()), name)
    x = np.random.RandomState(1).randint(0, 101, (2, 40))
    with torch.no_grad():
      ref = m(torch.tensor(x), output_hidden_states=True)
    out = from_pretrained(path).forward(jnp.asarray(x), collect_hidden=True)
    rows[name] = dict(
        max_logit_diff=float(np.abs(np.asarray(out["logits"]) - ref.logits.numpy()).max()),
        max_hidden_diff=max(float(np.abs(np.asarray(a) - b.numpy()).max())
                            for a, b in zip(out["hidden_states"], ref.hidden_states)))
    print(name, rows[name], flush=True)
  os.makedirs(os.path.join(_ROOT, "results"), exist_ok=True)
  with open(os.path.join(_ROOT, "results", "qwen3_parity.json"), "w") as f:
    json.dump(dict(command="python benchmarks/parity_report.py", dtype="float32",
                   machine=dict(platform=platform.platform(), cpu_count=os.cpu_count()),
                   configs=rows), f, indent=1)


if __name__ == "__main__":
  main()
