"""A word-level `tokenizers` tokenizer fit on a synthetic world's text plus the action tags."""

from __future__ import annotations

import re
from typing import Iterable, Sequence

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from trace_jax.envs import prompts, react
from trace_jax.envs.worlds.synthetic_schema import RELATIONS
from trace_jax.envs.worlds.synthetic_world import World
from trace_jax.envs.types import Doc

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
TAG_TOKENS = react.ALL_TAGS  # think, search, answer, information: open and close.
_PLACEHOLDER_RE = re.compile(r"\{[a-z]\}")


def _pre_tokenizer(digits: bool = False) -> pre_tokenizers.PreTokenizer:
  parts = [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(behavior="isolated")]
  if digits:
    parts.append(pre_tokenizers.Digits(individual_digits=True))
  return pre_tokenizers.Sequence(parts)


_DIGIT_SPACE = re.compile(r"(?<=\d)\s+(?=[\d.])|(?<=\.)\s+(?=\d)")


def rejoin_digits(text: str) -> str:
  """Undoes what `word_tokenizer(digits=True)`'s `decode` does to numbers: the digits (and a
  decimal point) it spaced apart are joined ("4 0 . 5" -> "40.5")."""
  return _DIGIT_SPACE.sub("", text)


def word_tokenizer(texts: Iterable[str], tags: Sequence[str], digits: bool = False) -> Tokenizer:
  """Word-level tokenizer over the words of `texts`: special tokens, then `tags` (added tokens:
  single ids that survive `decode`), then the words, sorted. Ids are deterministic given the
  texts: <pad>=0, <bos>=1, <eos>=2, <unk>=3, tags from 4. Names keep their case; punctuation is
  split off; with `digits`, numbers are split into single digits (ten tokens cover every number).
  `decode` joins tokens with spaces."""
  tag_re = re.compile("|".join(re.escape(t) for t in tags))
  pre = _pre_tokenizer(digits)
  words = set()
  for text in texts:
    text = _PLACEHOLDER_RE.sub(" ", tag_re.sub(" ", text))
    words.update(w for w, _ in pre.pre_tokenize_str(text))
  if digits:
    words.update("0123456789")
  words -= set(SPECIAL_TOKENS) | set(tags)
  vocab = {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS) + list(tags) + sorted(words))}
  tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
  tok.pre_tokenizer = _pre_tokenizer(digits)
  tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
  tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in tags])
  return tok


def _protocol_texts(topk: int, schema: dict = RELATIONS) -> list[str]:
  """Every fixed text the environment, the prompts and the expert can emit."""
  fake = [Doc(id="x", title="x", text="x")] * max(topk, 1)
  texts = [
      react.format_observation(fake), react.format_observation([]),
      react.format_invalid_observation(), react.format_error_observation(),
      prompts.synthetic_prompt("what is ?"), "need no found the answer is . ? yes",
  ]
  for rel in schema.values():
    texts += [rel.fact, rel.noun, rel.query_passage, rel.misleading or ""]
    texts += [t for pair in rel.decoys for t in pair]
  return texts


def _world_texts(world: World) -> Iterable[str]:
  yield from _protocol_texts(world.config.topk, world.relations)
  for doc in world.corpus:
    yield doc.title
    yield doc.text
  for ex in world.train + world.test:
    yield ex.question
  yield " ".join(world.entities)


def build_tokenizer(world: World) -> Tokenizer:
  """Word-level tokenizer of a synthetic world (`word_tokenizer` over its texts and the protocol's
  fixed texts, with the eight ReAct tags)."""
  return word_tokenizer(_world_texts(world), TAG_TOKENS)


def build_hf_tokenizer(world: World):
  """`build_tokenizer(world)` wrapped as a `transformers.PreTrainedTokenizerFast`."""
  from transformers import PreTrainedTokenizerFast  # Heavy import; only when asked for.

  return PreTrainedTokenizerFast(
      tokenizer_object=build_tokenizer(world), pad_token=PAD, bos_token=BOS, eos_token=EOS,
      unk_token=UNK,
  )
