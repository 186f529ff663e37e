"""The knob reference of `configs/README.md`, written from the one definition of every knob
(`trace_jax.config`): `python -m configs.reference` rewrites it, `--check` exits 1 when it is stale
(a test runs that)."""

from __future__ import annotations

import os
import sys

from trace_jax.config import knob_table

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")
BEGIN = ("<!-- knobs: written by `python -m configs.reference`; edit trace_jax/config.py "
         "instead -->")
END = "<!-- end of knobs -->"
SECTIONS = ("", "model", "world", "data", "retriever", "env", "sft", "rollout", "rl", "eval",
            "ckpt")


def reference() -> str:
  """Every knob by section: name, default, allowed values, doc."""
  parts = [BEGIN, "## Every knob", "",
           "Defaults are the typed config's (`trace_jax.config`); a variant of a config file "
           "overrides some of them (`configs/mhqa.py` and the task files say which).", ""]
  for s in SECTIONS:
    parts += [f"### {f'`{s}`' if s else 'Top level'}", "", knob_table(s), ""]
  return "\n".join(parts + [END]) + "\n"


def updated(text: str) -> str:
  """`text` (the README) with its knob reference replaced (or appended)."""
  if BEGIN in text and END in text:
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1].lstrip("\n")
    return head + reference() + tail
  return text.rstrip("\n") + "\n\n" + reference()


def main(argv: list[str]) -> int:
  with open(README) as f:
    text = f.read()
  new = updated(text)
  if "--check" in argv:
    if new != text:
      print("configs/README.md's knob reference is stale: run python -m configs.reference")
      return 1
    return 0
  with open(README, "w") as f:
    f.write(new)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
