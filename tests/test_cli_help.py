"""Every argparse help text of the repository's scripts formats: argparse fills `%(default)s`-style
fields, so a bare `%` (as in "95%") makes `--help` crash (it did, in lessons_table.py)."""

import ast
import glob
import os
import re

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
FIELDS = re.compile(r"%%|%\(\w+\)[a-z]")  # what argparse formats; any other % is bare


def bare_percent(text: str) -> bool:
  return "%" in FIELDS.sub("", text)


def _help_texts(path):
  tree = ast.parse(open(path).read(), path)
  for node in ast.walk(tree):
    if isinstance(node, ast.Call) and getattr(node.func, "attr", "") in (
        "add_argument", "ArgumentParser", "add_parser", "add_argument_group"):
      for kw in node.keywords:
        if kw.arg in ("help", "description", "epilog") and isinstance(kw.value, ast.Constant) \
            and isinstance(kw.value.value, str):
          yield node.lineno, kw.value.value


def test_no_argparse_help_has_a_bare_percent():
  files = [f for d in ("launch", "projects", "benchmarks", "trace_jax", "tests", "configs")
           for f in glob.glob(os.path.join(ROOT, d, "**", "*.py"), recursive=True)]
  assert len(files) > 50
  checked, bad = 0, []
  for f in files:
    for line, text in _help_texts(f):
      checked += 1
      if bare_percent(text):
        bad.append(f"{os.path.relpath(f, ROOT)}:{line}: {text!r}")
  assert checked > 20 and not bad, bad


def test_the_check_sees_a_bare_percent():
  assert bare_percent("at 95% together") and bare_percent("100%%%")
  assert not bare_percent("95%% or %(default)s, %(prog)s")
