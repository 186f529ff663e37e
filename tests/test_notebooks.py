"""Executes every notebook under notebooks/ top to bottom at its smallest size; no cell may raise.

The committed notebooks keep the outputs of a full-size run (figures included) so they read well on
the repository page; the test checks those too.
"""

import glob
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

# Figures a notebook must show (embedded PNGs), by file name; at least one for any other notebook.
MIN_IMAGES = {"01_quickstart.ipynb": 3,  # the allocation plot, all trees, one tree with p̂
              "03_reuse.ipynb": 3}       # stage-1 counts, the page table, a sampled tree
# Tree pictures a notebook writes to its working directory.
PICTURES = {"01_quickstart.ipynb": "quickstart_trees.png", "03_reuse.ipynb": "reuse_tree.png"}


def _kernel_env():
  """The kernel is this interpreter (the venv's python) with the repository importable."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", TRACE_JAX_NOTEBOOK_FAST="1")
  env.pop("MPLBACKEND", None)  # the kernel's inline backend embeds the figures
  env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  return env


def _images(nb):
  return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
          if "image/png" in o.get("data", {})]


def _errors(nb):
  return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
          if o.get("output_type") == "error"]


def test_notebooks_exist():
  assert set(MIN_IMAGES) <= {os.path.basename(p) for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_saved_notebook_has_outputs_and_installs_in_colab(path):
  nb = nbformat.read(path, as_version=4)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert all(c.get("execution_count") for c in code), "saved without running every cell"
  assert not _errors(nb)
  assert len(_images(nb)) >= MIN_IMAGES.get(os.path.basename(path), 1)
  first = code[0].source
  assert "'google.colab' in sys.modules" in first.replace('"', "'") and "pip" in first


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, tmp_path, monkeypatch):
  nb = nbformat.read(path, as_version=4)
  for c in nb.cells:  # run from a clean slate, not the saved outputs
    if c.cell_type == "code":
      c.outputs, c.execution_count = [], None
  # The python3 kernel runs this interpreter (the venv's) once its bin/ leads PATH.
  env = _kernel_env()
  env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
  monkeypatch.delenv("MPLBACKEND", raising=False)
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                   resources={"metadata": {"path": str(tmp_path)}})
  client.execute()
  assert not _errors(nb), _errors(nb)
  assert all(c.get("execution_count") for c in nb.cells if c.cell_type == "code")
  name = os.path.basename(path)
  # The rendered tree pictures were written and embedded.
  assert name not in PICTURES or (tmp_path / PICTURES[name]).exists()
  assert len(_images(nb)) >= MIN_IMAGES.get(name, 1)
