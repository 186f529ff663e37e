"""BM25 retrieval over Search-R1 jsonl corpora."""

import json

import numpy as np
import pytest

from trace_jax.envs.retrieval import bm25 as retrieval
from trace_jax.envs.retrieval.bm25 import BM25Retriever, load_corpus_jsonl
from trace_jax.envs.types import Doc

DOCS = [
    Doc("d0", "Zantro", "Zantro is based in Orsk ."),
    Doc("d1", "Kelmor", "Kelmor founded Zantro ."),
    Doc("d2", "Kelmar", "Kelmar is called the founder of Zantro ."),
    Doc("d3", "Orsk", "Orsk is a city in Vendia ."),
    Doc("d4", "Vendia", "Vendia is a country ."),
]


@pytest.fixture(scope="module")
def retriever():
  return BM25Retriever.from_docs(DOCS)


def test_tokenizer_lowercases_drops_stopwords_no_stemming():
  assert retrieval.tokenize_for_bm25("The founder OF Zantro, founded!") == [
      "founder", "zantro", "founded"]


def test_wording_decides_ranking(retriever):
  founded, founder = retriever.search(["founded Zantro", "founder of Zantro"], k=1)
  assert founded[0].id == "d1" and founder[0].id == "d2"
  assert founded[0].score > 0 and isinstance(founded[0].score, float)


def test_zero_score_hits_are_dropped(retriever):
  hits = retriever.search(["Vendia"], k=5)[0]
  assert {d.id for d in hits} == {"d3", "d4"}  # Only the passages that mention Vendia.
  assert hits[0].score >= hits[1].score
  assert retriever.search(["nothing matches here", "", "the of a"], k=3) == [[], [], []]


def test_k_larger_than_corpus_and_argument_errors(retriever):
  assert len(retriever.search(["Zantro"], k=100)[0]) == 3
  assert retriever.search([], k=2) == []
  with pytest.raises(TypeError, match="sequence of queries"):
    retriever.search("Zantro", k=2)
  with pytest.raises(ValueError, match="k must be"):
    retriever.search(["Zantro"], k=0)
  with pytest.raises(ValueError, match="non-empty"):
    BM25Retriever.from_docs([])


def test_batch_equals_one_by_one(retriever):
  queries = ["founded Zantro", "Orsk city", "zzz", "founder of Zantro"]
  batched = retriever.search(queries, k=2)
  assert batched == [retriever.search([q], k=2)[0] for q in queries]


def test_jsonl_roundtrip_and_title_split(tmp_path):
  path = tmp_path / "corpus.jsonl"
  retrieval.write_corpus_jsonl(DOCS, str(path))
  docs = load_corpus_jsonl(str(path))
  assert docs == DOCS
  path.write_text(json.dumps({"id": 7, "contents": "\"Quoted Title\"\nBody text"}) + "\n\n"
                  + json.dumps({"contents": "single line"}) + "\n")
  a, b = load_corpus_jsonl(str(path))
  assert (a.id, a.title, a.text) == ("7", "Quoted Title", "Body text")
  assert (b.id, b.title, b.text) == ("1", "", "single line")
  r = BM25Retriever.from_jsonl(str(path))
  assert r.search(["body"], k=1)[0][0].id == "7"


@pytest.mark.parametrize("line,message", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"id": "x"}', "missing string field 'contents'"),
    ('{"id": "x", "contents": 5}', "missing string field 'contents'"),
    ('{"id": [1], "contents": "a"}', "field 'id'"),
])
def test_malformed_jsonl_names_file_and_line(tmp_path, line, message):
  path = tmp_path / "bad.jsonl"
  path.write_text(json.dumps({"id": "ok", "contents": "t\nx"}) + "\n" + line + "\n")
  with pytest.raises(ValueError, match=message) as e:
    load_corpus_jsonl(str(path))
  assert f"{path}:2" in str(e.value)


def test_save_load(tmp_path, retriever):
  retriever.save(str(tmp_path / "idx"))
  loaded = BM25Retriever.load(str(tmp_path / "idx"))
  queries = ["founded Zantro", "Vendia country", "founder"]
  assert loaded.search(queries, k=3) == retriever.search(queries, k=3)
  assert loaded.docs == retriever.docs
  with pytest.raises(FileNotFoundError, match="not a saved BM25Retriever"):
    BM25Retriever.load(str(tmp_path / "missing"))


def test_top_k_breaks_ties_by_index_and_drops_zero_scores():
  from trace_jax.envs.retrieval.bm25 import top_k

  s = np.array([0.5, 2.0, 0.0, 2.0, 1.0, 2.0 + 1e-7])  # 1, 3 and 5 tie to 4 decimals
  assert top_k(s, 2).tolist() == [1, 3]
  assert top_k(s, 4).tolist() == [1, 3, 5, 4]
  assert top_k(s, 10).tolist() == [1, 3, 5, 4, 0]  # the zero score is no hit
  assert top_k(s[::-1], 2).tolist() == [0, 2]  # reversed order: the lower indices still win
  assert top_k(np.zeros(3), 2).tolist() == [] and top_k(s, 0).tolist() == []
  rng = np.random.default_rng(0)
  r = rng.random(500)
  assert top_k(r, 7).tolist() == np.argsort(-r, kind="stable")[:7].tolist()
