"""Scoring against hand-derived values and an oracle written from the official scripts."""

import collections
import re
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_jax.envs import scoring


# --- Oracle: the official SQuAD v1.1 normalize/EM and HotpotQA F1, transcribed line by line. ---

def oracle_normalize(s):
  def remove_articles(text):
    return re.sub(r"\b(a|an|the)\b", " ", text)

  def white_space_fix(text):
    return " ".join(text.split())

  def remove_punc(text):
    exclude = set(string.punctuation)
    return "".join(ch for ch in text if ch not in exclude)

  return white_space_fix(remove_articles(remove_punc(s.lower())))


def oracle_em(prediction, ground_truth):
  return oracle_normalize(prediction) == oracle_normalize(ground_truth)


def oracle_f1(prediction, ground_truth):
  normalized_prediction = oracle_normalize(prediction)
  normalized_ground_truth = oracle_normalize(ground_truth)
  if (normalized_prediction in ["yes", "no", "noanswer"]
      and normalized_prediction != normalized_ground_truth):
    return 0
  if (normalized_ground_truth in ["yes", "no", "noanswer"]
      and normalized_prediction != normalized_ground_truth):
    return 0
  prediction_tokens = normalized_prediction.split()
  ground_truth_tokens = normalized_ground_truth.split()
  common = collections.Counter(prediction_tokens) & collections.Counter(ground_truth_tokens)
  num_same = sum(common.values())
  if num_same == 0:
    return 0
  precision = 1.0 * num_same / len(prediction_tokens)
  recall = 1.0 * num_same / len(ground_truth_tokens)
  return (2 * precision * recall) / (precision + recall)


def oracle_max(metric, prediction, golds):
  return max(metric(prediction, g) for g in golds)


# (prediction, golds, expected EM, expected F1), derived by hand from the algorithm above.
CASES = [
    ("The Beatles", ["beatles"], 1, 1.0),
    ("a  cat!", ["cat"], 1, 1.0),
    ("Theatre", ["theatre"], 1, 1.0),  # "the" is only removed as a whole word.
    ("the atre", ["atre"], 1, 1.0),
    ("Apple Inc.", ["apple inc"], 1, 1.0),
    ("New York City", ["New York"], 0, 0.8),  # P = 2/3, R = 1.
    ("cat cat dog", ["cat dog dog"], 0, 2 / 3),  # Multiset overlap 2, P = R = 2/3.
    ("yes", ["no"], 0, 0.0),
    ("Yes.", ["yes"], 1, 1.0),
    ("yes it is", ["yes"], 0, 0.0),  # Gold is special and differs: F1 0 despite overlap.
    ("no answer", ["noanswer"], 0, 0.0),
    ("noanswer", ["noanswer"], 1, 1.0),
    ("", ["x"], 0, 0.0),
    ("", [""], 1, 0.0),  # Both normalize to "": equal, but no common token.
    ("the the the", ["a"], 1, 0.0),  # Articles only: normalizes to "".
    ("Café", ["cafe"], 0, 0.0),  # No unicode folding in the official script.
    ("“quoted”", ["quoted"], 0, 0.0),  # Curly quotes are not in string.punctuation.
    ("O'Neil", ["oneil"], 1, 1.0),
    ("A.B.", ["ab"], 1, 1.0),
    ("Bob  and\tAlice\n", ["bob and alice"], 1, 1.0),
    ("Paris", ["London", "paris"], 1, 1.0),  # Max over golds.
    ("Paris France", ["London", "paris"], 0, 2 / 3),  # P = 1/2, R = 1.
    ("ÉCOLE normale", ["école"], 0, 2 / 3),  # Unicode lowercases.
]


@pytest.mark.parametrize("prediction,golds,em,f1", CASES)
def test_table(prediction, golds, em, f1):
  assert scoring.exact_match(prediction, golds) == em
  assert scoring.f1(prediction, golds) == pytest.approx(f1)
  assert scoring.exact_match(prediction, golds) == oracle_max(oracle_em, prediction, golds)
  assert scoring.f1(prediction, golds) == pytest.approx(oracle_max(oracle_f1, prediction, golds))


_PIECES = st.sampled_from(
    ["a", "an", "the", "The", "yes", "no", "noanswer", "Paris", "new", "york", "cat", ".", ",",
     "!", "'", "-", " ", "  ", "\t", "é", "Ü", "“", "theatre", "x1"]
)
_TEXT = st.lists(_PIECES, max_size=8).map(lambda xs: " ".join(xs) if len(xs) % 2 else "".join(xs))


@settings(max_examples=300, deadline=None)
@given(_TEXT, st.lists(_TEXT, min_size=1, max_size=3))
def test_matches_oracle(prediction, golds):
  assert scoring.normalize_answer(prediction) == oracle_normalize(prediction)
  assert scoring.exact_match(prediction, golds) == oracle_max(oracle_em, prediction, golds)
  assert scoring.f1(prediction, golds) == pytest.approx(oracle_max(oracle_f1, prediction, golds))


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=30), st.text(max_size=30))
def test_matches_oracle_arbitrary_unicode(prediction, gold):
  assert scoring.exact_match(prediction, [gold]) == oracle_em(prediction, gold)
  assert scoring.f1(prediction, gold) == pytest.approx(oracle_f1(prediction, gold))


def test_single_gold_string_and_none_prediction():
  assert scoring.exact_match("Paris", "paris") == 1.0
  assert scoring.exact_match(None, ["paris"]) == 0.0
  assert scoring.f1(None, ["paris"]) == 0.0


def test_empty_golds_raise():
  with pytest.raises(ValueError, match="gold"):
    scoring.exact_match("x", [])
  with pytest.raises(ValueError, match="gold"):
    scoring.f1("x", [])


def test_rewards():
  assert scoring.em_reward("Paris", ["paris"]) == 1.0
  assert scoring.em_reward("Paris", ["paris"], False) == 1.0
  assert scoring.f1_reward("Paris France", ["paris"]) == pytest.approx(2 / 3)
  r = scoring.em_format_reward
  assert r("Paris", ["paris"], True) == 1.0
  assert r("Paris", ["paris"], False) == pytest.approx(0.9)
  assert r("Rome", ["paris"], True) == pytest.approx(0.1)
  assert r("Rome", ["paris"], False) == 0.0
  assert r(None, ["paris"], True) == 0.0
  assert r("Rome", ["paris"], True, format_weight=0.0) == 0.0


def test_get_reward_fn():
  assert scoring.get_reward_fn("em") is scoring.em_reward
  assert scoring.get_reward_fn("f1") is scoring.f1_reward
  assert scoring.get_reward_fn("em_format") is scoring.em_format_reward
  with pytest.raises(ValueError, match="unknown reward 'bleu'"):
    scoring.get_reward_fn("bleu")
