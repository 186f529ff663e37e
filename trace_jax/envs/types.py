"""Types shared by the environment, the retrievers and the data readers."""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence


@dataclasses.dataclass(frozen=True)
class Doc:
  """One retrieved passage. `title` is the first line of a Search-R1 style `contents` field."""

  id: str
  title: str
  text: str
  score: float = 0.0

  @property
  def contents(self) -> str:
    return f"{self.title}\n{self.text}" if self.title else self.text


class Retriever(Protocol):
  """Anything that answers a batch of queries with the top-k passages for each."""

  def search(self, queries: Sequence[str], k: int) -> list[list[Doc]]:
    ...
