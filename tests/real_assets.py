"""Everything the real-checkpoint path reads, made locally in a directory with nothing downloaded:
a random tiny Hugging Face `Qwen3ForCausalLM` (safetensors), a BPE tokenizer trained on the spot
with a Qwen-style chat template and special tokens, Search-R1 parquet train/test files and a
Search-R1 jsonl corpus.

  paths = make_real_assets(str(tmp_path))   # dict: model, train, test, corpus, facts

The world is a list of made-up facts ("the capital of Vemora is Tashkel"): each becomes a corpus
passage and a question whose answer is in that passage. The random model gets a few torch steps
on expert trajectories (`teach_format`) so that it emits searches the server answers.
"""

from __future__ import annotations

import json
import os

import numpy as np

from trace_jax.envs.prompts import SEARCH_R1_INSTRUCTION, search_r1_prompt

# Qwen's chat markup: the Search-R1 prompt is wrapped in it and the policy ends a turn with
# <|im_end|> (its eos).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TAGS = ("<think>", "</think>", "<search>", "</search>", "<information>", "</information>",
        "<answer>", "</answer>")

# The tiny model: 2 layers, hidden 64, 4 query / 2 KV heads of 16 (the KV heads divide tensor:2).
MODEL = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=1024,
             rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)

_SYL = ("ka", "lo", "mi", "ra", "te", "vo", "shu", "ne", "bar", "dim", "gol", "pes", "quin", "zor")
_RELATIONS = (("capital", "the capital of {s} is {o}", "what is the capital of {s}"),
              ("founder", "{s} was founded by {o}", "who founded {s}"),
              ("river", "the river of {s} is the {o}", "which river flows through {s}"))


def _name(rng) -> str:
  return "".join(rng.choice(_SYL, size=int(rng.integers(2, 4)))).capitalize()


def make_facts(n: int = 24, seed: int = 0) -> list[dict]:
  """`n` made-up facts: subject, relation, object, passage text and question."""
  rng = np.random.default_rng(seed)
  facts, seen = [], set()
  while len(facts) < n:
    s, o = _name(rng), _name(rng)
    if s in seen or s == o:
      continue
    seen.add(s)
    rel, text, q = _RELATIONS[len(facts) % len(_RELATIONS)]
    facts.append(dict(id=str(len(facts)), subject=s, relation=rel, answer=o,
                      passage=text.format(s=s, o=o) + ".", question=q.format(s=s, o=o) + "?"))
  return facts


def write_corpus(facts, path: str) -> None:
  """Search-R1 jsonl corpus: {"id", "contents": "\"Title\"\\ntext"} a line."""
  with open(path, "w") as f:
    for x in facts:
      f.write(json.dumps({"id": x["id"], "contents": f"\"{x['subject']}\"\n{x['passage']}"}) + "\n")


def write_searchr1_parquet(facts, path: str, split: str) -> None:
  """Search-R1's parquet layout: data_source, prompt (chat messages), ability, reward_model
  (ground_truth.target), extra_info (split, index)."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  rows = dict(
      data_source=["madeup_qa"] * len(facts),
      prompt=[[{"role": "user", "content": search_r1_prompt(x["question"])}] for x in facts],
      ability=["fact-reasoning"] * len(facts),
      reward_model=[{"style": "rule", "ground_truth": {"target": [x["answer"]]}} for x in facts],
      extra_info=[{"split": split, "index": i} for i in range(len(facts))])
  pq.write_table(pa.table(rows), path)


def train_tokenizer(texts, vocab_size: int):
  """A byte-level BPE trained on `texts`, as a `PreTrainedTokenizerFast` with exactly
  `vocab_size` tokens (filler special tokens pad it up to the model's embedding size)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size - 16, special_tokens=list(SPECIAL_TOKENS),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(texts, trainer)
  tok.add_tokens(list(TAGS))
  n = tok.get_vocab_size()
  if n > vocab_size:
    raise ValueError(f"tokenizer has {n} tokens, more than the model's {vocab_size}")
  tok.add_special_tokens([f"<|extra_{i}|>" for i in range(vocab_size - n)])
  hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                               pad_token="<|endoftext|>",
                               additional_special_tokens=["<|im_start|>", "<|im_end|>"])
  hf.chat_template = CHAT_TEMPLATE
  assert len(hf) == vocab_size, (len(hf), vocab_size)
  return hf


def expert_turns(x) -> tuple[str, str, str]:
  """An expert trajectory for fact `x`: a search for its subject, the passage the server returns,
  the answer (Search-R1 markup)."""
  obs = f"\n\n<information>Doc 1(Title: {x['subject']}) {x['passage']}</information>\n\n"
  return f"<search> {x['subject']} </search>", obs, f"<answer> {x['answer']} </answer>"


def teach_format(model, tok, facts, steps: int = 40, lr: float = 5e-3, seed: int = 0) -> list:
  """A few AdamW steps (torch) on expert trajectories, loss on the policy's own tokens only, so
  the random model searches and answers in Search-R1 markup instead of babbling. Returns losses."""
  import torch

  from trace_jax.envs.prompts import build_search_r1_prompt

  rows = []
  for x in facts:
    search, obs, answer = expert_turns(x)
    parts = [(build_search_r1_prompt(x["question"], tok), False), (search, True), (obs, False),
             (answer, True)]
    ids, mask = [], []
    for text, trained in parts:
      t = tok.encode(text, add_special_tokens=False)
      ids += t
      mask += [trained] * len(t)
    rows.append((ids, mask))
  n = max(len(r[0]) for r in rows)
  inp = torch.full((len(rows), n), tok.pad_token_id, dtype=torch.long)
  labels = torch.full((len(rows), n), -100, dtype=torch.long)
  attn = torch.zeros((len(rows), n), dtype=torch.long)
  for i, (ids, mask) in enumerate(rows):
    inp[i, :len(ids)] = torch.tensor(ids)
    attn[i, :len(ids)] = 1
    labels[i, :len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, mask)])
  torch.manual_seed(seed)
  opt = torch.optim.AdamW(model.parameters(), lr=lr)
  model.train()
  losses = []
  for _ in range(steps):
    loss = model(input_ids=inp, attention_mask=attn, labels=labels).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(float(loss.detach()))
  model.eval()
  return losses


def make_real_assets(base: str, n_train: int = 16, n_test: int = 8, seed: int = 0,
                     format_steps: int = 40) -> dict:
  """Writes model (with tokenizer), train/test parquet and corpus under `base`; returns paths, the
  facts and the losses of `teach_format` (`format_steps` steps; 0 leaves the model random)."""
  import torch
  import transformers

  facts = make_facts(n_train + n_test, seed)
  os.makedirs(base, exist_ok=True)
  paths = dict(model=os.path.join(base, "model"), train=os.path.join(base, "train.parquet"),
               test=os.path.join(base, "test.parquet"), corpus=os.path.join(base, "corpus.jsonl"))
  write_corpus(facts, paths["corpus"])
  write_searchr1_parquet(facts[:n_train], paths["train"], "train")
  write_searchr1_parquet(facts[n_train:], paths["test"], "test")
  texts = [SEARCH_R1_INSTRUCTION] + [x["passage"] for x in facts] + \
          [x["question"] for x in facts] + [f"\"{x['subject']}\"" for x in facts]
  tok = train_tokenizer(texts * 4, MODEL["vocab_size"])
  torch.manual_seed(seed)
  cfg = transformers.Qwen3Config(**MODEL, bos_token_id=None,
                                 eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                                 pad_token_id=tok.pad_token_id)
  model = transformers.Qwen3ForCausalLM(cfg)
  # 12 trajectories teach the markup; more only cost time (each step runs them all)
  losses = teach_format(model, tok, facts[:12], steps=format_steps, seed=seed) if format_steps \
      else []
  model.save_pretrained(paths["model"], safe_serialization=True)
  tok.save_pretrained(paths["model"])
  return dict(paths, facts=facts, format_losses=losses)
