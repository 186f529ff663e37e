"""Bad input fails up front, naming the field or the file: every case of the reliability issue's
"late or silent crashes on bad input" list, checked through `configs/mhqa.validate` (before
anything is built or compiled), `load_qa` and the asset loaders."""

import dataclasses
import json
import os

import pytest

from configs import convert, mhqa
from trace_jax import assets as assets_lib
from trace_jax.data import formats
from trace_jax.data.formats import QAFormatError, load_qa

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from trace_jax.allocation import strategies  # noqa: E402


def _smoke(**overrides):
  c = mhqa.get_config("smoke")
  for dotted, v in overrides.items():
    node = c
    *path, last = dotted.split("__")
    for k in path:
      node = node[k]
    node[last] = v
  return c


def test_every_shipped_synthetic_variant_and_method_validates():
  for variant in ("tiny", "smoke"):
    for method in strategies.names():
      c = mhqa.get_config(variant)
      c.method = method
      tc = mhqa.validate(c)
      assert (tc.method, tc.variant) == (method, variant)


# (override, a phrase the error must contain). Each was a late crash or a silent success before.
BAD = [
    (dict(eval__every=0), "eval.every=0 must be >= 1"),
    (dict(ckpt__every=0), "ckpt.every=0 must be >= 1"),
    (dict(rl__micro_batches=0), "rl.micro_batches=0 must be >= 1"),
    (dict(rl__steps=-1), "rl.steps=-1 must be >= 0"),
    (dict(rollout__temperature=-1.0), "rollout.temperature=-1.0 must be a finite number > 0"),
    (dict(rollout__temperature=0.0), "rollout.top_k=1"),  # says how to get (nearly) greedy
    (dict(rollout__temperature=float("nan")), "rollout.temperature=nan"),
    (dict(eval__size=0), "eval.size=0 must be >= 1"),
    (dict(rollout__root_budget=3), "root_budget=3 is smaller"),
    (dict(rollout__root_budget=1000), "root_budget=1000 is larger"),
    (dict(rollout__prefix_budget=-1), "rollout.prefix_budget=-1"),
    (dict(rollout__min_per_prompt=0), "rollout.min_per_prompt=0"),
    (dict(rollout__max_per_prompt=1), "max_per_prompt=1 is smaller than min_per_prompt=2"),
    (dict(rollout__prompts_per_step=0), "rollout.prompts_per_step=0"),
    (dict(rollout__max_per_anchor=0), "rollout.max_per_anchor=0"),
    (dict(rollout__candidate_prompts=2), "candidate_prompts=2 must be 0 or at least"),
    (dict(rollout__top_p=0.0), "rollout.top_p=0.0"),
    (dict(rollout__budget_unit="tokenz"), "rollout.budget_unit='tokenz'"),
    (dict(rl__train_rows=0), "rl.train_rows=0"),
    (dict(rl__advantage="ppo"), "rl.advantage='ppo'"),
    (dict(ckpt__max_to_keep=0), "ckpt.max_to_keep=0"),
    (dict(env__max_turns=0), "env.max_turns=0"),
    (dict(env__max_obs_tokens=0), "env.max_obs_tokens=0"),
    (dict(env__max_obs_bytes=10), "env.max_obs_bytes=10 must be >= 64"),
    (dict(env__max_seq_len=24), "env.max_seq_len=24 must exceed"),
    (dict(retriever__kind="http"), "needs --config.retriever.url"),
    (dict(retriever__kind="http", retriever__url="127.0.0.1:8000"), "must start with http://"),
    (dict(retriever__kind="elastic"), "retriever.kind='elastic'"),
    (dict(retriever__timeout_s=0.0), "retriever.timeout_s=0.0 must be a finite number > 0"),
    (dict(retriever__retries=-1), "retriever.retries=-1"),
    (dict(retriever__backoff_s=-0.5), "retriever.backoff_s=-0.5"),
    (dict(retriever__topk=0), "retriever.topk=0"),
    (dict(method="ppo"), "config.method='ppo'"),
    # Each of these trained for steps before the divergence guard stopped it, or failed deep inside.
    (dict(rl__lr=float("nan")), "rl.lr=nan must be a finite number"),
    (dict(rl__lr=0.0), "rl.lr=0.0 must be a finite number > 0"),
    (dict(rl__max_grad_norm=float("inf")), "rl.max_grad_norm=inf must be a finite number"),
    (dict(rl__entropy_coef=-0.1), "rl.entropy_coef=-0.1 must be >= 0"),
    (dict(rl__remat="some"), "rl.remat='some'"),
    (dict(model__dtype="float8"), "model.dtype='float8'"),
    (dict(env__reward="bleu"), "env.reward='bleu'"),
    (dict(sft__min_lr_ratio=1.5), "sft.min_lr_ratio=1.5 must be in [0, 1]"),
    (dict(rollout__anchor_prior_strength=0.0), "rollout.anchor_prior_strength=0.0"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[m for _, m in BAD])
def test_validate_rejects_with_the_field_named(overrides, message):
  with pytest.raises(ValueError) as info:
    mhqa.validate(_smoke(**overrides))
  assert message in str(info.value), str(info.value)


def test_zero_steps_and_documented_edge_values_are_allowed():
  mhqa.validate(_smoke(rl__steps=0))  # warm start and the first evaluation only
  mhqa.validate(_smoke(env__max_obs_bytes=0))  # no byte cap, explicitly
  mhqa.validate(_smoke(rollout__temperature=0.05, rollout__top_k=1))  # nearly greedy rollouts
  mhqa.validate(_smoke(retriever__retries=0, retriever__backoff_s=0.0))
  assert "rl.steps=0" in convert.validate.__doc__ and "top_k=1" in convert.validate.__doc__


def test_unknown_fields_are_named_and_missing_ones_take_their_defaults():
  c = mhqa.get_config("smoke")
  c.rl.lerning_rate = 1e-3  # a typo a ConfigDict would carry silently
  with pytest.raises(ValueError, match=r"config.rl: unknown field\(s\) \['lerning_rate'\]"):
    mhqa.validate(c)
  c = mhqa.get_config("smoke")
  c.rl.lr = 1e-5
  del c.rl["lr"], c.rollout["temperature"]
  tc = mhqa.validate(c)
  assert (tc.rl.lr, tc.rollout.temperature) == (2e-4, 0.8)  # the definitions' defaults


@pytest.mark.parametrize("section,field,value,message", [
    ("rl", "steps", "3", "config.rl.steps='3': expected int"),
    ("rl", "steps", 2.5, "config.rl.steps=2.5: expected int"),
    ("rollout", "cost_aware", 1, "config.rollout.cost_aware=1: expected bool"),
    ("model", "path", None, "config.model.path=None: expected str"),
])
def test_the_typed_config_checks_each_type(section, field, value, message):
  """A config reaching the library as a plain dict (a run's config.json, a notebook) is
  type-checked field by field (a ConfigDict already refuses most of these)."""
  d = mhqa.get_config("smoke").to_dict()
  d[section][field] = value
  with pytest.raises(ValueError) as info:
    convert.to_train_config(d)
  assert message in str(info.value), str(info.value)


def test_validate_returns_the_typed_config():
  tc = mhqa.validate(_smoke(rl__lr=1e-4))
  assert type(tc).__name__ == "TrainConfig" and tc.rl.lr == 1e-4 and isinstance(tc.rl.lr, float)
  with pytest.raises(dataclasses.FrozenInstanceError):
    tc.rl.lr = 1.0


# ----------------------------------------------------------------------------- real data and model


def _model_dir(path, files=("config.json", "model.safetensors", "tokenizer.json")):
  path.mkdir(parents=True, exist_ok=True)
  for name in files:
    (path / name).write_text("{}")
  return str(path)


def _qwen(tmp_path, train="train.jsonl", test="test.jsonl", model_files=None):
  rec = {"id": "1", "question": "q?", "golden_answers": ["a"]}
  for name in {train, test}:
    p = tmp_path / name
    if not p.exists():
      p.write_text(json.dumps(rec) + "\n")
  c = mhqa.get_config("qwen3_8b")
  c.model.path = _model_dir(tmp_path / "model", *(() if model_files is None else (model_files,)))
  c.data.train_path, c.data.test_path = str(tmp_path / train), str(tmp_path / test)
  c.retriever.url = "http://127.0.0.1:8000"
  return c


def test_real_variant_validates_with_complete_files(tmp_path):
  c = _qwen(tmp_path)
  tc = mhqa.validate(c)
  assert (tc.model.path, tc.data.train_path, tc.data.test_path, tc.retriever.url) == (
      c.model.path, c.data.train_path, c.data.test_path, c.retriever.url)


def test_empty_train_or_test_file_is_named(tmp_path):
  (tmp_path / "empty.jsonl").write_text("")
  for field in ("train", "test"):
    c = _qwen(tmp_path, **{field: "empty.jsonl"})
    with pytest.raises(ValueError, match=f"data.{field}_path=.*empty.jsonl: the file is empty"):
      mhqa.validate(c)


def test_missing_or_directory_data_path_is_named(tmp_path):
  c = _qwen(tmp_path)
  c.data.test_path = str(tmp_path / "nope.jsonl")
  with pytest.raises(FileNotFoundError, match="data.test_path=.*nope.jsonl: no such file"):
    mhqa.validate(c)
  c.data.test_path = str(tmp_path)
  with pytest.raises(IsADirectoryError, match="data.test_path=.*a directory"):
    mhqa.validate(c)


@pytest.mark.parametrize("files,expected", [
    ((), "config.json"),
    (("config.json",), "safetensors"),
    (("config.json", "model.safetensors"), "tokenizer.json"),
])
def test_incomplete_model_directory_names_the_file_it_expected(tmp_path, files, expected):
  c = _qwen(tmp_path, model_files=files)
  with pytest.raises(FileNotFoundError) as info:
    mhqa.validate(c)
  assert expected in str(info.value) and c.model.path in str(info.value)
  # The asset loader runs the same check before it touches the tokenizer.
  with pytest.raises(FileNotFoundError, match=expected):
    assets_lib.load_real_assets(c)


def test_model_directory_variants_that_are_accepted(tmp_path):
  sharded = _model_dir(tmp_path / "m1", ("config.json", "model-00001-of-00002.safetensors",
                                         "vocab.json"))
  assets_lib.check_model_dir(sharded)
  weights = _model_dir(tmp_path / "m2", ("config.json", "model.safetensors"))
  tok = _model_dir(tmp_path / "tok", ("tokenizer.model",))
  assets_lib.check_model_dir(weights, tok)
  with pytest.raises(FileNotFoundError, match="model.path=.*not a directory"):
    assets_lib.check_model_dir(str(tmp_path / "missing"))


def test_a_file_whose_every_record_is_skipped_is_named(tmp_path):
  p = tmp_path / "noanswers.jsonl"
  p.write_text(json.dumps({"id": "1", "question": "q", "golden_answers": []}) + "\n")
  c = _qwen(tmp_path)
  c.data.train_path = str(p)
  with pytest.raises(ValueError, match="data.train_path=.*noanswers.jsonl: no usable examples"):
    assets_lib.load_examples(c, "train_path")


# ----------------------------------------------------------------------------- load_qa


def test_load_qa_names_the_file_on_a_binary_jsonl(tmp_path):
  p = tmp_path / "data.jsonl"
  p.write_bytes(b'{"question": "q", "golden_answers": ["a"]}\n\xff\xfe\x00\x81binary')
  with pytest.raises(QAFormatError) as info:
    load_qa(p)
  assert str(p) in str(info.value) and "not UTF-8" in str(info.value)
  assert not isinstance(info.value, UnicodeDecodeError)
  (tmp_path / "data.csv").write_bytes(b"Question,Answer\n\xff\xff,x\n")
  with pytest.raises(QAFormatError, match="data.csv: not UTF-8"):
    load_qa(tmp_path / "data.csv")


@pytest.mark.parametrize("name,content,message", [
    ("empty.jsonl", "", "the file is empty"),
    ("blank.jsonl", "\n  \n", "no records"),
    ("list.json", "[]", "no records"),
    ("header.csv", "Question,Answer\n", "no records"),
])
def test_load_qa_refuses_empty_files(tmp_path, name, content, message):
  p = tmp_path / name
  p.write_text(content)
  with pytest.raises(QAFormatError, match=message) as info:
    load_qa(p)
  assert info.value.path == str(p)


def test_load_qa_rejects_a_directory_clearly(tmp_path):
  with pytest.raises(QAFormatError, match="is a directory"):
    load_qa(tmp_path)
  with pytest.raises(FileNotFoundError):
    load_qa(tmp_path / "absent.jsonl")
  assert formats.QAFormatError is QAFormatError


# ----------------------------------------------------------------------------- synthetic world


def test_synthetic_world_without_test_questions_is_an_error_not_nan(tmp_path):
  from trace_jax.envs.worlds.synthetic_world import SyntheticWorldConfig, generate_world

  world = generate_world(SyntheticWorldConfig(seed=2, n_entities=120, n_train=8, n_test=4))
  world.test = []
  c = _smoke(world__cache_dir=str(tmp_path), world__seed=2)
  world.save(os.path.join(str(tmp_path), "world-seed2"))
  with pytest.raises(ValueError, match="8 train and 0 test questions"):
    assets_lib.load_world_assets(c)


def test_a_value_the_variant_does_not_read_is_refused():
  """`--config.data.train_path=missing.parquet` on a synthetic variant used to be ignored (the run
  trained on the synthetic world and exited 0); a value no part of the run reads is refused."""
  from configs import fc, runs, tool_math

  for v in ("tiny", "smoke", "lessons", "real_smoke", "qwen3_8b", "qwen3_14b"):
    runs.check_overrides(mhqa.get_config(v))  # every shipped variant as it is
  for mod in (tool_math, fc):
    runs.check_overrides(mod.get_config("smoke"))
  for config, field, value in [(mhqa.get_config("smoke"), "data.train_path", "missing.parquet"),
                               (mhqa.get_config("tiny"), "model.path", "/ckpt/Qwen3-8B"),
                               (mhqa.get_config("tiny"), "world.n_relations", 8),
                               (mhqa.get_config("qwen3_8b"), "world.trap_rate", 0.9),
                               (tool_math.get_config("smoke"), "retriever.topk", 5)]:
    sec, name = field.split(".")
    config[sec][name] = value
    with pytest.raises(ValueError, match=f"does not read --config.{field}="):
      runs.check_overrides(config)
  c = mhqa.get_config("lessons")
  c.world.n_relations = 8  # the lessons world reads it
  runs.check_overrides(c)


def test_an_ensemble_of_two_heads_is_refused_up_front():
  """Two heads leave one bootstrap member beside the model's head: no spread to read."""
  with pytest.raises(ValueError, match="predictor_ensemble=2"):
    mhqa.validate(_smoke(rl__predictor_ensemble=2))
  mhqa.validate(_smoke(rl__predictor_ensemble=3))
