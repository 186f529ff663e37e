"""Host-side construction of the decode step's attention tables (numpy, static shapes).

Slots forked from the same anchor share that anchor's full KV pages. Such slots form a *group*: the
tree attention kernel reads the group's prefix pages once for all its branches, and each slot keeps
only its own pages (from the copy of the anchor's partial page on) as its *suffix*. Table widths are
rounded up to a small set of page-count buckets so the decode step compiles once per bucket.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from trace_jax.rollout.paged_kv import NULL_PAGE


def page_buckets(max_pages: int, buckets=()) -> tuple[int, ...]:
  """Sorted page-table widths: the given ones, or powers of two (from 4) capped by max_pages."""
  if buckets:
    out = sorted({int(b) for b in buckets if b > 0})
    if out[-1] < max_pages:
      out.append(max_pages)
    return tuple(out)
  out, b = [], 4
  while b < max_pages:
    out.append(b)
    b *= 2
  out.append(max_pages)
  return tuple(out)


def pick_bucket(need: int, buckets: tuple[int, ...]) -> int:
  for b in buckets:
    if b >= need:
      return b
  raise ValueError(f"need {need} pages but the largest bucket is {buckets[-1]}")


@dataclasses.dataclass
class SlotView:
  """What the table builder needs to know about one decoding slot.

  pages: the slot's page table; length: tokens with K/V after this step's write (kv_len + 1);
  group_key: identity of the anchor the slot was forked from (None: no sharing);
  shared_pages: how many leading pages of `pages` are the anchor's shared full pages.
  """

  pages: list[int]
  length: int
  group_key: object = None
  shared_pages: int = 0


def _pad_rows(rows: list[list[int]], width: int, n: int) -> np.ndarray:
  out = np.full((n, width), NULL_PAGE, np.int32)
  for i, r in enumerate(rows):
    out[i, :len(r)] = r
  return out


def plain_tables(slots: list[SlotView | None], buckets: tuple[int, ...]) -> dict:
  """Per-slot page tables without sharing: page_table i32[S, P], lens i32[S]."""
  need = max([len(s.pages) for s in slots if s is not None] + [1])
  width = pick_bucket(need, buckets)
  rows = [s.pages if s is not None else [] for s in slots]
  lens = np.asarray([s.length if s is not None else 0 for s in slots], np.int32)
  return {"page_table": _pad_rows(rows, width, len(slots)), "lens": lens}


def tree_tables(slots: list[SlotView | None], page_size: int, max_groups: int, group_size: int,
                buckets: tuple[int, ...]) -> dict:
  """Group and suffix tables for `tree_attention`.

  Slots sharing a group key (and at least one shared page) are packed into groups of at most
  `group_size`; larger families split into several groups (each still reads the prefix once per
  `group_size` branches). Spare group rows go to lone forked slots with the longest shared prefix,
  which keeps the suffix tables short. Slots left over attend to all their pages as a suffix.

  Returns group_pages i32[NG, Pg], group_lens i32[NG], group_slots i32[NG, B] (-1 pad),
  suffix_pages i32[S, Ps], suffix_lens i32[S].
  """
  families: dict[object, list[int]] = {}
  for i, s in enumerate(slots):
    if s is not None and s.group_key is not None and s.shared_pages > 0:
      families.setdefault(s.group_key, []).append(i)
  chunks = []
  for members in families.values():
    for j in range(0, len(members), group_size):
      chunks.append(members[j:j + group_size])
  # Multi-branch chunks first (they save the most), then long lone prefixes.
  chunks.sort(key=lambda c: (len(c) > 1, slots[c[0]].shared_pages * len(c)), reverse=True)
  chunks = chunks[:max_groups]
  grouped = {i for c in chunks for i in c}

  g_rows = [slots[c[0]].pages[:slots[c[0]].shared_pages] for c in chunks]
  g_lens = [len(r) * page_size for r in g_rows]
  s_rows, s_lens = [], []
  for i, s in enumerate(slots):
    if s is None:
      s_rows.append([])
      s_lens.append(0)
    elif i in grouped:
      s_rows.append(s.pages[s.shared_pages:])
      s_lens.append(s.length - s.shared_pages * page_size)
    else:
      s_rows.append(s.pages)
      s_lens.append(s.length)
  pg = pick_bucket(max([len(r) for r in g_rows] + [1]), buckets)
  ps = pick_bucket(max([len(r) for r in s_rows] + [1]), buckets)
  group_slots = np.full((max_groups, group_size), -1, np.int32)
  for gi, c in enumerate(chunks):
    group_slots[gi, :len(c)] = c
  group_lens = np.zeros(max_groups, np.int32)
  group_lens[:len(g_lens)] = g_lens
  return {"group_pages": _pad_rows(g_rows, pg, max_groups), "group_lens": group_lens,
          "group_slots": group_slots, "suffix_pages": _pad_rows(s_rows, ps, len(slots)),
          "suffix_lens": np.asarray(s_lens, np.int32)}


__all__ = ["SlotView", "page_buckets", "pick_bucket", "plain_tables", "tree_tables"]
