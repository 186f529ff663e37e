"""Prompts: Search-R1's instruction for real models and a short one for the synthetic world."""

from __future__ import annotations

from typing import Any

SEARCH_R1_INSTRUCTION = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first "
    "every time you get new information. After reasoning, if you find you lack some knowledge, "
    "you can call a search engine by <search> query </search> and it will return the top "
    "searched results between <information> and </information>. You can search as many times "
    "as your want. If you find no further external knowledge needed, you can directly provide "
    "the answer inside <answer> and </answer>, without detailed illustrations. For example, "
    "<answer> Beijing </answer>. Question: {question}\n"
)


def search_r1_prompt(question: str) -> str:
  """The Search-R1 instruction with the question filled in (plain text, no chat template)."""
  question = question.strip()
  if question and question[-1] != "?":
    question += "?"
  return SEARCH_R1_INSTRUCTION.format(question=question)


def build_search_r1_prompt(question: str, tokenizer: Any = None) -> str:
  """The Search-R1 prompt, wrapped in the tokenizer's chat template when it has one.

  `tokenizer` is a `transformers` tokenizer or None; the result is text ready for `encode`
  (the template's generation prompt is appended so the model starts its first turn).
  """
  content = search_r1_prompt(question)
  if tokenizer is not None and getattr(tokenizer, "chat_template", None):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
  return content


def synthetic_prompt(question: str) -> str:
  """The synthetic world's short prompt; the model's first turn follows it."""
  return f"question : {question.strip()}\n"
