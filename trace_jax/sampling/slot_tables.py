"""Host-side construction of the decode step's attention tables (numpy, static shapes).

Slots forked from the same anchor share that anchor's full KV pages. Such slots form a *group*: the
tree attention kernel reads the group's prefix pages once for all its branches, and each slot keeps
only its own pages (from the copy of the anchor's partial page on) as its *suffix*. Table widths are
rounded up to a small set of page-count buckets so the decode step compiles once per bucket.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from trace_jax.sampling.paged_kv import NULL_PAGE


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


def _pad_rows(rows: list[list[int]], width: int, n: int, null_page: int = NULL_PAGE) -> np.ndarray:
  out = np.full((n, width), null_page, np.int32)
  for i, r in enumerate(rows):
    out[i, :len(r)] = r
  return out


def plain_tables(slots: list[SlotView | None], buckets: tuple[int, ...],
                 null_page: int = NULL_PAGE) -> dict:
  """Per-slot page tables without sharing: page_table i32[S, P], lens i32[S]."""
  need = max([len(s.pages) for s in slots if s is not None] + [1])
  width = pick_bucket(need, buckets)
  rows = [s.pages if s is not None else [] for s in slots]
  lens = np.asarray([s.length if s is not None else 0 for s in slots], np.int32)
  return {"page_table": _pad_rows(rows, width, len(slots), null_page), "lens": lens}


def tree_tables(slots: list[SlotView | None], page_size: int, max_groups: int, group_size: int,
                buckets: tuple[int, ...], null_page: int = NULL_PAGE) -> dict:
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
  return {"group_pages": _pad_rows(g_rows, pg, max_groups, null_page), "group_lens": group_lens,
          "group_slots": group_slots,
          "suffix_pages": _pad_rows(s_rows, ps, len(slots), null_page),
          "suffix_lens": np.asarray(s_lens, np.int32)}


def _widen(a: np.ndarray, width: int, fill: int) -> np.ndarray:
  if a.shape[1] >= width:
    return a
  return np.concatenate([a, np.full((a.shape[0], width - a.shape[1]), fill, a.dtype)], axis=1)


def sharded_tables(slots: list[SlotView | None], shards: int, pages_per_shard: int,
                   page_size: int, groups_per_shard: int, group_size: int,
                   buckets: tuple[int, ...], tree: bool = True) -> dict:
  """Tree tables for a pool split into `shards` contiguous page ranges (see `PoolLayout`).

  Slot block d (`len(slots) // shards` slots) lives on shard d: its groups are packed among
  themselves into group rows block d (`groups_per_shard` rows), its padding points at shard d's
  null page (`d * pages_per_shard`), and slot ids in group_slots stay global. Widths are the
  largest bucket any shard needs. tree=False: no groups (every slot attends to its whole table as
  a suffix), the sharded form of `plain_tables`.
  """
  per = len(slots) // shards
  parts = []
  for d in range(shards):
    sub, null = slots[d * per:(d + 1) * per], d * pages_per_shard
    if tree:
      t = tree_tables(sub, page_size, groups_per_shard, group_size, buckets, null)
      t["group_slots"] = np.where(t["group_slots"] >= 0, t["group_slots"] + d * per, -1)
    else:
      p = plain_tables(sub, buckets, null)
      t = {"group_pages": np.full((groups_per_shard, 1), null, np.int32),
           "group_lens": np.zeros(groups_per_shard, np.int32),
           "group_slots": np.full((groups_per_shard, 1), -1, np.int32),
           "suffix_pages": p["page_table"], "suffix_lens": p["lens"]}
    parts.append((null, t))
  out = {}
  for k in ("group_lens", "suffix_lens"):
    out[k] = np.concatenate([t[k] for _, t in parts])
  for k, fill in (("group_pages", None), ("group_slots", -1), ("suffix_pages", None)):
    width = max(t[k].shape[1] for _, t in parts)
    out[k] = np.concatenate([_widen(t[k], width, null if fill is None else fill)
                             for null, t in parts])
  return out


__all__ = ["SlotView", "page_buckets", "pick_bucket", "plain_tables", "sharded_tables",
           "tree_tables"]
