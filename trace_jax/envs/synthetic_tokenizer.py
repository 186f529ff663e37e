"""A word-level `tokenizers` tokenizer fit on a synthetic world's text plus the action tags."""

from __future__ import annotations

import re
from typing import Iterable

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from trace_jax.envs import prompts, react
from trace_jax.envs.synthetic_schema import RELATIONS
from trace_jax.envs.synthetic_world import World
from trace_jax.envs.types import Doc

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
TAG_TOKENS = react.ALL_TAGS  # think, search, answer, information: open and close.
_TAG_RE = re.compile("|".join(re.escape(t) for t in TAG_TOKENS))
_PLACEHOLDER_RE = re.compile(r"\{[a-z]\}")


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
  return pre_tokenizers.Sequence(
      [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(behavior="isolated")]
  )


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
  """Word-level tokenizer: special tokens, then the eight tags, then the world's words, sorted.

  Ids are deterministic given the world: <pad>=0, <bos>=1, <eos>=2, <unk>=3, tags from 4. The tags
  are added (non-special) tokens, so they are single ids and survive `decode`. Names keep their
  case; punctuation is split off. `decode` joins tokens with spaces.
  """
  pre = _pre_tokenizer()
  words = set()
  for text in _world_texts(world):
    text = _PLACEHOLDER_RE.sub(" ", _TAG_RE.sub(" ", text))
    words.update(w for w, _ in pre.pre_tokenize_str(text))
  words -= set(SPECIAL_TOKENS) | set(TAG_TOKENS)
  vocab = {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS) + list(TAG_TOKENS) + sorted(words))}
  tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
  tok.pre_tokenizer = _pre_tokenizer()
  tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
  tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
  return tok


def build_hf_tokenizer(world: World):
  """`build_tokenizer(world)` wrapped as a `transformers.PreTrainedTokenizerFast`."""
  from transformers import PreTrainedTokenizerFast  # Heavy import; only when asked for.

  return PreTrainedTokenizerFast(
      tokenizer_object=build_tokenizer(world), pad_token=PAD, bos_token=BOS, eos_token=EOS,
      unk_token=UNK,
  )
