"""One definition per knob: every field of the run config has its default, allowed values and doc
in `trace_jax.config`, and everything else derives from it (the config files' ConfigDict, the
checks, the reference in configs/README.md, the driver's config)."""

import ast
import dataclasses
import glob
import os

import pytest

from configs import base, mhqa, reference
from trace_jax.allocation.driver import DriverConfig, driver_config
from trace_jax.config import (RolloutSection, TrainConfig, check_knobs, knob_error, knobs,
                              sampler_config, update_config)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_knob_has_a_doc_and_a_default_its_own_definition_allows():
  ks = knobs()
  assert len(ks) == len({name for name, *_ in ks}) > 100
  for name, type_name, default, meta in ks:
    assert meta.get("doc", "").strip(), f"{name} has no doc"
    assert type(default).__name__ == type_name, name
    assert knob_error(name, default, meta) is None, name
  check_knobs(TrainConfig())


def test_the_config_files_start_from_the_typed_defaults():
  assert base.base_config().to_dict() == TrainConfig().to_dict()
  assert mhqa.get_config("tiny").to_dict() == TrainConfig().to_dict()


def _assignments(path):
  """(dotted knob, literal value, line) of every `c.section.field = literal` in a config file."""
  out = []
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
      t = node.targets[0]
      parts = []
      while isinstance(t, ast.Attribute):
        parts.append(t.attr)
        t = t.value
      if isinstance(t, ast.Name) and t.id == "c" and parts:
        try:
          value = ast.literal_eval(node.value)
        except ValueError:
          continue
        out.append((".".join(reversed(parts)), value, node.lineno))
  return out


def test_no_config_file_writes_a_default_again():
  """A variant overrides values; one that sets a knob to its typed default writes the default a
  second time (and would drift from it)."""
  defaults = {name: default for name, _, default, _ in knobs()}
  files = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))
  assert any(f.endswith("mhqa.py") for f in files)
  again = [f"{os.path.basename(f)}:{line} {name}={value!r}" for f in files
           for name, value, line in _assignments(f)
           if name in defaults and value == defaults[name] and name != "variant"]
  assert not again, again


def test_knob_ranges_are_checked_from_their_definitions():
  for name, value, message in [("rl.ppo_epochs", 0, "rl.ppo_epochs=0 must be >= 1"),
                               ("rollout.top_p", 0.0, r"rollout.top_p=0.0 must be in \(0, 1\]"),
                               ("rl.remat", "some", "rl.remat='some'; choose one of"),
                               ("rl.lr", 0.0, "rl.lr=0.0 must be a finite number > 0"),
                               ("rl.predictor_holdout", 1.0,
                                r"rl.predictor_holdout=1.0 must be in \[0, 1\)")]:
    section, field = name.split(".")
    c = TrainConfig()
    c = c.replace(**{section: dataclasses.replace(getattr(c, section), **{field: value})})
    with pytest.raises(ValueError, match=message):
      check_knobs(c)


def test_the_driver_config_is_the_rollout_section():
  """DriverConfig adds only the method and the slice's accounting to the rollout section: its
  other fields and their defaults are the section's own."""
  rollout = {f.name: f.default for f in dataclasses.fields(RolloutSection)}
  extra = {f.name for f in dataclasses.fields(DriverConfig)} - set(rollout)
  assert extra == {"method", "count_slice"}
  assert issubclass(DriverConfig, RolloutSection)
  c = TrainConfig()
  d = driver_config(c)
  assert all(getattr(d, k) == getattr(c.rollout, k) for k in rollout) and d.method == c.method


@pytest.mark.parametrize("build,section,pairs", [
    (sampler_config, "rollout", dict(num_slots=3, page_size=8, num_pages=99, temperature=0.5,
                                     top_p=0.9, top_k=7, decode_steps=3)),
    (sampler_config, "env", dict(max_seq_len=111, max_turn_tokens=11, max_obs_tokens=12,
                                 max_turns=2)),
    (update_config, "rl", dict(lr=0.125, predictor_lr=0.25, eps_low=0.1, eps_high=0.3,
                               kl_coef=0.5, entropy_coef=0.75, max_grad_norm=2.0,
                               micro_batches=3, remat="dots")),
])
def test_the_parts_configs_take_every_shared_field_from_the_run(build, section, pairs):
  """The sampler's and the update's configs keep defaults of their own for use outside a run; in
  a run every field they share with a section is the run's value, never their default."""
  c = TrainConfig()
  c = c.replace(**{section: dataclasses.replace(getattr(c, section), **pairs)})
  part = build(c)
  assert {k: getattr(part, k) for k in pairs} == pairs


def test_the_knob_reference_is_up_to_date():
  """configs/README.md lists every knob as trace_jax/config.py defines it
  (`python -m configs.reference` rewrites it)."""
  assert reference.main(["--check"]) == 0
  text = open(reference.README).read()
  for name, *_ in knobs():
    assert f"`{name}`" in text, name
