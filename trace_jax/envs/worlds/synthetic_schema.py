"""The synthetic world's schema: entity types, relations with their wordings, sentence templates.

Every text is lowercase template words around capitalized names, tokens separated by spaces, so a
word-level tokenizer covers it exactly. Wordings matter for retrieval (BM25 does no stemming):
  fact           the true sentence, stored in the subject's passage, or in the object's passage
                 when `on_object_side` (then the subject's name appears there only once);
  noun           the question's noun phrase `the {noun} of X`, and the "question wording" query
                 `{noun} of X`;
  query_passage  the "passage wording" query, in the fact's own words;
  misleading     for trap relations, a planted sentence that matches the question wording.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

ENTITY_TYPES = ("country", "city", "person", "company", "university")


@dataclasses.dataclass(frozen=True)
class Relation:
  """A typed relation with its wordings.

  fact: the true sentence; on_object_side: stored in the object's passage instead of the
  subject's; noun: the question's noun phrase `the {noun} of X`; query_passage: a query in the
  passage's words; misleading: the planted sentence matching the noun wording (trap relations);
  decoys: further (query, misleading sentence) wordings (`lessons_world`).
  """

  name: str
  subject_type: str
  object_type: str
  fact: str
  noun: str
  query_passage: str
  on_object_side: bool = False
  misleading: Optional[str] = None
  # The lessons world: other query wordings, each with the planted sentence it surfaces,
  # ((query template with {x}, misleading template with {w} and {s}), ...).
  decoys: tuple = ()

  def question_query(self, x: str) -> str:
    return f"{self.noun} of {x}"


RELATIONS = {
    r.name: r
    for r in [
        Relation("born_in", "person", "city", "{s} was born in {o} .", "birthplace", "{x} born in"),
        Relation("works_for", "person", "company", "{s} works for {o} .", "employer",
                 "{x} works for"),
        Relation("studied_at", "person", "university", "{s} studied at {o} .", "university",
                 "{x} studied at"),
        Relation("founded_by", "company", "person", "{o} founded {s} .", "founder", "founded {x}",
                 on_object_side=True, misleading="{w} is called the founder of {s} ."),
        Relation("company_city", "company", "city", "{s} is based in {o} .", "city",
                 "{x} based in"),
        Relation("uni_city", "university", "city", "{s} is located in {o} .", "city",
                 "{x} located in"),
        Relation("city_country", "city", "country", "{s} is a city in {o} .", "country",
                 "{x} city in"),
        Relation("capital", "country", "city", "the government of {s} sits in {o} .", "capital",
                 "government of {x}", on_object_side=True,
                 misleading="{w} was the old capital of {s} ."),  # Also states w's country.
    ]
}
# A capital's (or old capital's) passage states its country through that sentence instead.
CITY_COUNTRY_ALTERNATIVES = (
    "the government of {o} sits in {s} .", "{s} was the old capital of {o} .",
)

# Relations that may follow each relation (by the object's type), minus immediate loops.
NEXT_RELATIONS_BY_TYPE = {t: [r.name for r in RELATIONS.values() if r.subject_type == t]
                 for t in ENTITY_TYPES}
FORBIDDEN_RELATION_PAIRS = {("capital", "city_country")}

DISTRACTOR_TEMPLATES = {
    "person": "{s} once met {y} .",
    "company": "{s} competes with {y} .",
    "university": "{s} partners with {y} .",
    "city": "{s} is twinned with {y} .",
    "country": "{s} borders {y} .",
}
TYPE_INTROS = {"country": "{s} is a country .", "university": "{s} is a university ."}

NAME_ONSETS = ("b c d f g h k l m n p r s t v z br dr gr kr pl st tr th sk").split()
NAME_VOWELS = ("a", "e", "i", "o", "u")
NAME_CODAS = ("", "", "n", "r", "l", "s", "k", "m", "th")
RESERVED_NAMES = {"Doc", "Title", "Invalid", "Use", "Search", "Try", "No"}
