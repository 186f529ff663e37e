"""Diagnostics of the synthetic world's planted signal on sampled trees.

`prefix_signal` asks the question the method depends on: after a search that surfaced the
misleading passage of a trap hop, does the rest of the trajectory succeed less often than after a
search that surfaced the needed passage?
"""

from __future__ import annotations

import numpy as np


def _shown(obs: str, title: str) -> bool:
  return f"Title : {title} )" in obs or f"Title: {title})" in obs


def _first_trap_hop(world, meta):
  for rel, subj in zip(meta["relations"], meta["chain"][:-1]):
    key = f"{rel}|{subj}"
    if key in world.traps:
      return world.needed_doc_id(rel, subj), set(world.traps[key])
  return None


def classify_rollout(tree, leaf_id, world) -> str | None:
  """'good' / 'bad' by the first observation showing the needed or a misleading passage of the
  question's first trap hop; None when the question has no trap hop or neither passage showed."""
  hop = _first_trap_hop(world, tree.meta.get("meta", {}))
  if hop is None:
    return None
  needed, wrong = hop
  for nid in tree.path(leaf_id)[1:]:
    obs = tree.nodes[nid].obs_text or ""
    if _shown(obs, needed):
      return "good"
    if any(_shown(obs, w) for w in wrong):
      return "bad"
  return None


def prefix_signal(trees, world) -> dict:
  """Success rate of rollouts after a good vs a misleading trap-hop search."""
  out = {"good": [], "bad": []}
  for t in trees:
    for leaf in t.leaves():
      cls = classify_rollout(t, leaf.id, world)
      if cls is not None:
        out[cls].append(float(leaf.reward or 0.0))
  g, b = out["good"], out["bad"]
  return dict(success_after_good=float(np.mean(g)) if g else float("nan"),
              success_after_bad=float(np.mean(b)) if b else float("nan"), n_good=len(g),
              n_bad=len(b), share_bad=len(b) / max(len(g) + len(b), 1))


def trap_allocation(examples, trees, world) -> dict:
  """Where a step's rollouts went, split by whether the question has a trap hop: the share of
  trap questions in the prompts drawn (the pool), in the prompts given rollouts, and among the
  step's rollouts, and the success rate and mixed-tree share of trap and other questions. A
  predictor that learned "trap questions fail" steers stage 1 away from the prompts on which
  the policy has to discover the passage wording; these numbers show whether it does."""
  def is_trap(meta):
    return _first_trap_hop(world, meta or {}) is not None
  out = {}
  if examples:
    out["pool_trap_share"] = float(np.mean([is_trap(e.get("meta")) for e in examples]))
  if not trees:
    return out
  flags = [is_trap(t.meta.get("meta")) for t in trees]
  leaves = [t.leaves() for t in trees]
  n_trap = sum(len(l) for l, f in zip(leaves, flags) if f)
  out["sampled_trap_share"] = float(np.mean(flags))
  out["rollouts_trap_share"] = n_trap / max(sum(len(l) for l in leaves), 1)
  for name, want in (("trap", True), ("other", False)):
    rs = [float(x.reward or 0.0) for l, f in zip(leaves, flags) if f == want for x in l]
    mixed = [t.mixed for t, f in zip(trees, flags) if f == want]
    if rs:
      out[f"reward_{name}"] = float(np.mean(rs))
      out[f"mixed_share_{name}"] = float(np.mean(mixed))
  return out


# ---- why rollouts fail ---------------------------------------------------------------------------
FAILURE_KINDS = ("no_answer", "misled", "wrong_entity", "search_missed", "wrong_answer")


def classify_failure(tree, leaf_id, world) -> str | None:
  """Why a rollout of a synthetic-world question failed; None when it succeeded.

  In the order checked: `no_answer` (the trajectory ended without an answer, e.g. out of turns),
  `misled` (the question's first trap hop surfaced a misleading passage before the needed one);
  then the first hop whose needed passage never showed in an observation: `wrong_entity` when no
  search named that hop's subject (the question's entity, or the one the previous hop found: a
  copying mistake, a skipped hop or an early answer), `search_missed` when a search named it and
  still missed the passage (the wording); else `wrong_answer` (every needed passage showed and the
  answer was still wrong: a reading or copying mistake).
  """
  leaf = tree.nodes[leaf_id]
  if float(leaf.reward or 0.0) > 0.5:
    return None
  path = [tree.nodes[i] for i in tree.path(leaf_id)[1:]]
  if "<answer>" not in leaf.text:
    return "no_answer"
  if classify_rollout(tree, leaf_id, world) == "bad":
    return "misled"
  obs = " ".join(n.obs_text or "" for n in path)
  meta = tree.meta.get("meta", {})
  for hop, needed in enumerate(meta.get("needed_doc_ids", [])):
    if not _shown(obs, needed):
      subject = meta["chain"][hop]
      searched = any(f" {subject} " in f" {q} " for q in map(_query, path))
      return "search_missed" if searched else "wrong_entity"
  return "wrong_answer"


def _query(node) -> str:
  """The query of a turn's search action, as the environment parsed it ('' for other turns)."""
  from trace_jax.envs.react import parse_action
  action = parse_action(node.text)
  return action.content if action.kind == "search" else ""


def failure_breakdown(trees, world) -> dict:
  """Shares of all rollouts (leaves) by outcome: `success` and each of `FAILURE_KINDS`."""
  counts = dict.fromkeys(("success", *FAILURE_KINDS), 0)
  for t in trees:
    for leaf in t.leaves():
      counts[classify_failure(t, leaf.id, world) or "success"] += 1
  n = max(sum(counts.values()), 1)
  return {k: v / n for k, v in counts.items()} | {"rollouts": sum(counts.values())}


# ---- what the predictor head could read ---------------------------------------------------------
# The sampler records `final_last`, the final-norm hidden state at a prefix's last token. The other
# variants are by-products of the same forward pass: the residual stream after the middle layer, and
# the final states averaged over the whole prefix or over the prompt (the question) alone.
FEATURE_VARIANTS = ("final_last", "mid_last", "final_mean", "prompt_mean", "final_last+mid_last",
                    "final_last+prompt_mean")


def make_feature_variants_step(graphdef):
  """Jitted teacher-forced forward: (state, tokens i32[B, T] right padded, lens i32[B], prompt_lens
  i32[B]) -> {variant: f32[B, D]} for the single variants of `FEATURE_VARIANTS`."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  def step(state, tokens, lens, prompt_lens):
    model = nnx.merge(graphdef, state)
    t = jnp.arange(tokens.shape[1])[None, :]
    mask = t < lens[:, None]
    out = model.forward(tokens, attn_mask=mask, collect_hidden=True, compute_logits=False)
    hs = out["hidden_states"]  # embeddings, after each layer but the last, final (normed)
    final, mid = out["hidden"].astype(jnp.float32), hs[(len(hs) - 1) // 2 + 1].astype(jnp.float32)
    last = jnp.maximum(lens - 1, 0)[:, None, None]

    def mean_over(x, m):
      m = m.astype(jnp.float32)[..., None]
      return (x * m).sum(1) / jnp.maximum(m.sum(1), 1.0)

    return {"final_last": jnp.take_along_axis(final, last, axis=1)[:, 0],
            "mid_last": jnp.take_along_axis(mid, last, axis=1)[:, 0],
            "final_mean": mean_over(final, mask),
            "prompt_mean": mean_over(final, t < prompt_lens[:, None])}

  return jax.jit(step)


def feature_variants(graphdef, state, trees, batch: int = 64, bucket: int = 64) -> dict:
  """Every variant of `FEATURE_VARIANTS` for every node of `trees` that has a recorded feature:
  {variant: {(tree index, node id): f32[D']}}, the concatenated variants included."""
  step = make_feature_variants_step(graphdef)
  keys, seqs, plens = [], [], []
  for ti, tree in enumerate(trees):
    for n in tree.nodes:
      if n.feature is not None:
        keys.append((ti, n.id))
        seqs.append(tree.path_tokens(n.id)[0])
        plens.append(len(tree.prompt_ids))
  out = {v: {} for v in FEATURE_VARIANTS}
  order = np.argsort([len(s) for s in seqs])  # similar lengths together: few padded tokens
  for lo in range(0, len(order), batch):
    idx = order[lo:lo + batch]
    width = -(-max(len(seqs[i]) for i in idx) // bucket) * bucket
    tokens = np.zeros((batch, width), np.int32)
    lens, pl = np.ones((batch,), np.int32), np.ones((batch,), np.int32)
    for r, i in enumerate(idx):
      tokens[r, :len(seqs[i])], lens[r], pl[r] = seqs[i], len(seqs[i]), plens[i]
    res = {k: np.asarray(v) for k, v in step(state, tokens, lens, pl).items()}
    for r, i in enumerate(idx):
      for k, v in res.items():
        out[k][keys[i]] = v[r]
  for combo in FEATURE_VARIANTS:
    if "+" in combo:
      a, b = combo.split("+")
      out[combo] = {key: np.concatenate([out[a][key], out[b][key]]) for key in out[a]}
  return out


def lesson_choice_probs(graphdef, params, assets, examples, chunk: int = 64) -> dict:
  """On a lessons world (`assets.world`, its held-out or train questions `examples`):
  {relation: mean over its hops in `examples` of the policy's probability of the fact verb
  among the relation's own verbs}, read at the first query word of each search of the oracle's
  trace (teacher-forced: the prefix is the oracle's, so every hop is measured whatever the policy
  would have done before it). A smooth measure of each lesson, unlike the fact-verb share of
  greedy searches, which flips wholesale when a lesson near one half moves a little. The final
  states come from the sampler's prompt-feature forward (`engine_ops.make_feature_step`), in
  rows of `chunk`."""
  from trace_jax.envs.worlds.synthetic import oracle_world
  from trace_jax.envs.worlds.synthetic_traces import expert_trace, trace_segments
  from trace_jax.sampling.engine_ops import make_feature_step
  from trace_jax.sft import encode_segments

  a, world = assets, assets.world
  oracle = oracle_world(world)
  open_tag = "<search>"

  def verb_id(v):
    ids = a.encode(" " + v)
    if len(ids) != 1:
      raise ValueError(f"verb {v!r} is {len(ids)} tokens; the measure needs one")
    return ids[0]

  verbs = {r: [verb_id(v["fact_verb"])] + [verb_id(d) for d in v["decoy_verbs"]]
           for r, v in world.lessons.items()}
  rows, rels = [], []
  rng = np.random.default_rng(0)
  for q in examples:
    segs = trace_segments(q, expert_trace(oracle, q, rng))
    hop = 0
    for i, (text, gen) in enumerate(segs):
      if gen and open_tag in text and hop < len(q.meta["relations"]):
        relation = q.meta["relations"][hop]
        hop += 1
        if relation not in verbs:  # a plain hop: nothing to choose
          continue
        cut = text.index(open_tag) + len(open_tag)
        ids, _ = encode_segments(a.encode, segs[:i] + [(text[:cut], True)], a.bos_id)
        rows.append(ids)
        rels.append(relation)
  n, width = len(rows), max(len(r) for r in rows)
  tokens = np.zeros((n + -n % chunk, width), np.int32)  # whole chunks: one compilation
  lens = np.ones(len(tokens), np.int32)
  for i, r in enumerate(rows):
    tokens[i, :len(r)], lens[i] = r, len(r)
  final_state = make_feature_step(graphdef)
  hidden = np.concatenate([np.asarray(final_state(params, tokens[i:i + chunk], lens[i:i + chunk]))
                           for i in range(0, len(tokens), chunk)])[:n]
  cand = np.asarray([verbs[r] for r in rels], np.int32)  # [n, W]: the fact verb first
  p = _choice_probs(graphdef, params, hidden, cand)
  by = {}
  for r, v in zip(rels, p):
    by.setdefault(r, []).append(float(v))
  return {r: float(np.mean(v)) for r, v in sorted(by.items())}


def _choice_probs(graphdef, params, hidden, cand) -> np.ndarray:
  """Softmax over each row's candidate tokens `cand` (i32[n, W]) of the next-token logits from
  final states `hidden` (f32[n, D]); the first candidate's probability per row."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  logits = nnx.merge(graphdef, params).logits(jnp.asarray(hidden))
  own = jnp.take_along_axis(logits.astype(jnp.float32), jnp.asarray(cand), axis=1)
  return np.asarray(jax.nn.softmax(own, axis=1)[:, 0])


class CompileCounter:
  """XLA compilations seen while it is registered (`n`), programs loaded from the persistent
  compilation cache instead (`hits`), and the seconds of both (`s`: a load is counted in the
  backend-compile event it replaces): for benchmarks that report what each step compiles.
  `with CompileCounter() as cc: ...`, or `start()` once for a whole script."""

  EVENT = "/jax/core/compile/backend_compile_duration"
  HIT = "/jax/compilation_cache/cache_hits"

  def __init__(self):
    self.events, self.hits, self.s = 0, 0, 0.0

  @property
  def n(self) -> int:
    return self.events - self.hits

  def _on(self, event, duration, **_):
    if event == self.EVENT:
      self.events += 1
      self.s += float(duration)

  def _on_event(self, event, **_):
    if event == self.HIT:
      self.hits += 1

  def start(self) -> "CompileCounter":
    import jax
    jax.monitoring.register_event_duration_secs_listener(self._on)
    jax.monitoring.register_event_listener(self._on_event)
    return self

  def stop(self) -> None:
    import jax
    jax.monitoring.unregister_event_duration_listener(self._on)
    jax.monitoring.unregister_event_listener(self._on_event)

  def __enter__(self):
    return self.start()

  def __exit__(self, *exc):
    self.stop()
