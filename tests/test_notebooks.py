"""Executes every notebook under notebooks/ top to bottom; no cell may raise."""

import glob
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")


def _kernel_env():
  """The kernel is this interpreter (the venv's python) with the repository importable."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("MPLBACKEND", None)  # the kernel's inline backend embeds the figures
  env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  return env


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, tmp_path, monkeypatch):
  nb = nbformat.read(path, as_version=4)
  # The python3 kernel runs this interpreter (the venv's) once its bin/ leads PATH.
  env = _kernel_env()
  env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
  monkeypatch.delenv("MPLBACKEND", raising=False)
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                   resources={"metadata": {"path": str(tmp_path)}})
  client.execute()
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if o.get("output_type") == "error"]
  assert not errors, errors
  assert all(c.get("execution_count") for c in nb.cells if c.cell_type == "code")
  # The rendered tree picture was written and embedded.
  assert (tmp_path / "quickstart_trees.png").exists() or "quickstart" not in path
  images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if "image/png" in o.get("data", {})]
  assert len(images) >= 2 or "quickstart" not in path  # the allocation plot and the trees
