"""Answer scoring (SQuAD v1.1 / HotpotQA official logic) and the reward functions built on it.

`normalize_answer`, `exact_match` and `f1` reproduce the official SQuAD v1.1 evaluation script;
`f1` adds HotpotQA's rule that a yes/no/noanswer prediction or gold scores F1 = 0 unless the
normalized strings are equal. Several gold answers: the maximum over golds, as both scripts do.
"""

from __future__ import annotations

import collections
import re
import string
from typing import Callable, Optional, Sequence, Union

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_SPECIAL_ANSWERS = ("yes", "no", "noanswer")

Golds = Union[str, Sequence[str]]
# reward_fn(prediction, golds, format_ok) -> reward in [0, 1]. `prediction` is None when the
# rollout never produced an answer.
RewardFn = Callable[[Optional[str], Golds, bool], float]


def normalize_answer(s: str) -> str:
  """Lower text and remove punctuation, articles and extra whitespace (SQuAD v1.1).

  Example:
    >>> normalize_answer("The  Eiffel Tower!")
    'eiffel tower'
  """
  s = s.lower()
  s = "".join(ch for ch in s if ch not in _PUNCTUATION)
  s = _ARTICLES.sub(" ", s)
  return " ".join(s.split())


def _as_golds(golds: Golds) -> list[str]:
  golds = [golds] if isinstance(golds, str) else list(golds)
  if not golds:
    raise ValueError("at least one gold answer is required")
  return golds


def _exact_match_one(prediction: str, gold: str) -> float:
  return float(normalize_answer(prediction) == normalize_answer(gold))


def _f1_one(prediction: str, gold: str) -> float:
  norm_pred, norm_gold = normalize_answer(prediction), normalize_answer(gold)
  # HotpotQA: a yes/no/noanswer answer is all or nothing.
  if norm_pred in _SPECIAL_ANSWERS and norm_pred != norm_gold:
    return 0.0
  if norm_gold in _SPECIAL_ANSWERS and norm_pred != norm_gold:
    return 0.0
  pred_tokens, gold_tokens = norm_pred.split(), norm_gold.split()
  common = collections.Counter(pred_tokens) & collections.Counter(gold_tokens)
  num_same = sum(common.values())
  if num_same == 0:
    return 0.0
  precision = num_same / len(pred_tokens)
  recall = num_same / len(gold_tokens)
  return 2 * precision * recall / (precision + recall)


def exact_match(prediction: Optional[str], golds: Golds) -> float:
  """1.0 if the normalized prediction equals any normalized gold, else 0.0.

  Args:
    prediction: the answer text, or None when the rollout never answered (scores 0).
    golds: one gold answer or a sequence of them (at least one).

  Example:
    >>> exact_match("The Eiffel Tower", ["eiffel tower", "la tour eiffel"])
    1.0
    >>> exact_match("Eiffel", "Eiffel Tower"), exact_match(None, "Eiffel Tower")
    (0.0, 0.0)
  """
  golds = _as_golds(golds)
  if prediction is None:
    return 0.0
  return max(_exact_match_one(prediction, g) for g in golds)


def f1(prediction: Optional[str], golds: Golds) -> float:
  """Token-level F1 of the normalized strings, maximum over golds (HotpotQA variant).

  Args:
    prediction: the answer text, or None (scores 0).
    golds: one gold answer or a sequence of them; yes/no/noanswer score all or nothing.

  Example:
    >>> round(f1("Eiffel Tower in Paris", "the Eiffel Tower"), 3)  # precision 1/2, recall 1
    0.667
    >>> f1("yes", ["no"])
    0.0
  """
  golds = _as_golds(golds)
  if prediction is None:
    return 0.0
  return max(_f1_one(prediction, g) for g in golds)


def em_reward(prediction: Optional[str], golds: Golds, format_ok: bool = True) -> float:
  """Exact match, ignoring format."""
  del format_ok
  return exact_match(prediction, golds)


def f1_reward(prediction: Optional[str], golds: Golds, format_ok: bool = True) -> float:
  """F1, ignoring format."""
  del format_ok
  return f1(prediction, golds)


def em_format_reward(
    prediction: Optional[str], golds: Golds, format_ok: bool = True, format_weight: float = 0.1
) -> float:
  """Exact match shaped by format, kept in [0, 1].

  Correct and well formed: 1. Correct with a format error along the way (an invalid action):
  1 - format_weight. Wrong but answered in a well-formed rollout: format_weight. Otherwise 0.
  """
  em = exact_match(prediction, golds)
  if em:
    return 1.0 if format_ok else 1.0 - format_weight
  return format_weight if (format_ok and prediction is not None) else 0.0


_REWARD_FNS: dict[str, RewardFn] = {
    "em": em_reward,
    "f1": f1_reward,
    "em_format": em_format_reward,
}


def get_reward_fn(name: str) -> RewardFn:
  """Looks up a reward function by name: one of `em`, `f1`, `em_format`."""
  try:
    return _REWARD_FNS[name]
  except KeyError:
    raise ValueError(f"unknown reward {name!r}; choose one of {sorted(_REWARD_FNS)}") from None
