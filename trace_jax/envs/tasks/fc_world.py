"""Function calling: a synthetic API with state, tasks that chain calls, JSON calls checked
against typed schemas, rewards from the final state and the answer.

The task (`FunctionCallingTask`, a `FunctionEnv` task): each turn the policy either calls one
function, `<call> {"name": "find_user", "arguments": {"name": "Mira"}} </call>`, and reads
`<response> {"user_id": 12} </response>`, or answers, `<answer> 120 </answer>`, which ends the
rollout. Every call is validated before it runs: JSON that does not parse, a name the API does not
have, a missing, extra or mistyped argument, an out-of-range number or a too-deep structure gets
an error response and changes nothing (never an exception). The reward is 1 when the episode's
*final state* equals the expected one (for tasks that change state) and the answer equals the
expected answer (for tasks that ask for one).

The API (`FUNCTIONS`, typed JSON schemas): users with balances, orders, transfers and refunds:
  find_user(name) -> user_id;  get_balance(user_id) -> balance;  list_orders(user_id) -> order_ids;
  get_order(order_id) -> user_id, total, refunded;  transfer(from_id, to_id, amount) -> ok;
  refund(order_id) -> ok.

The embedded generator (`generate_fc_world`) writes tasks from templates whose solutions chain
2-4 calls (a later call needs an earlier call's result), with an expert that solves them and a
planted systematic mistake per template (transfer direction swapped, the first order refunded
instead of the last, ...), made at a rate drawn per template, as the other embedded worlds do.
The expert says its procedure in the thought before the call ("refund the last order" or, the
mistake, "refund the first order"), as a person would: the choice is one word the policy writes,
and the call that follows copies ids by that choice (a first version kept the thought the same
and hid the choice inside the call's ids; its warm start never sampled the right procedure often
enough for 30 RL steps to flip a greedy choice).

A reader for BFCL-style JSON from a local path (`read_bfcl`): each record's question, its
function schemas and its ground-truth calls; `calls_match` checks calls against the ground truth
(names, and each argument among its allowed values).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from typing import ClassVar, Optional

import numpy as np

from trace_jax.envs.interface import FunctionEnv, StepResult, tool_or_answer
from trace_jax.envs.tasks.problem_world import ProblemWorld, stratified_rates
from trace_jax.envs.worlds.synthetic_tokenizer import rejoin_digits

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<call>", "</call>"
RESP_OPEN, RESP_CLOSE = "<response>", "</response>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
TAGS = (THINK_OPEN, THINK_CLOSE, CALL_OPEN, CALL_CLOSE, RESP_OPEN, RESP_CLOSE, ANSWER_OPEN,
        ANSWER_CLOSE)
STOP_STRINGS = (CALL_CLOSE, ANSWER_CLOSE)
MAX_CALL_CHARS = 400
MAX_JSON_DEPTH = 4
MAX_INT = 10 ** 9

FUNCTIONS = {
    "find_user": {"name": "str"},
    "get_balance": {"user_id": "int"},
    "list_orders": {"user_id": "int"},
    "get_order": {"order_id": "int"},
    "transfer": {"from_id": "int", "to_id": "int", "amount": "int"},
    "refund": {"order_id": "int"},
}
# The task first and no function list: the embedded tiny model learns the API from the traces,
# and a long preamble puts the names it must copy far from where it writes them (a first
# version with the signatures listed before the task warm-started at 0.000 held-out EM: the
# model wrote other users' names).
PROMPT = ("task : {task}\nuse the api : one call a turn as <call> json </call> , then "
          "<answer> result </answer> .\n")


def fc_prompt(task: str) -> str:
  return PROMPT.replace("{task}", task)


# ---- the API and its validation -----------------------------------------------------------------


class CallError(ValueError):
  """A call the API refuses (the reason is the message)."""


def _depth(x, d=0) -> int:
  if isinstance(x, dict):
    return max([_depth(v, d + 1) for v in x.values()], default=d + 1)
  if isinstance(x, list):
    return max([_depth(v, d + 1) for v in x], default=d + 1)
  return d


def parse_call(text: str) -> tuple[str, dict]:
  """(name, arguments) of a JSON call, validated against `FUNCTIONS`; CallError otherwise."""
  if len(text) > MAX_CALL_CHARS:
    raise CallError(f"call longer than {MAX_CALL_CHARS} characters")
  try:
    call = json.loads(text)
  except (json.JSONDecodeError, RecursionError, ValueError):
    raise CallError("invalid json") from None
  if not isinstance(call, dict) or _depth(call) > MAX_JSON_DEPTH:
    raise CallError("a call is an object with name and arguments")
  name, args = call.get("name"), call.get("arguments", {})
  if set(call) - {"name", "arguments"}:
    raise CallError("a call has only name and arguments")
  if not isinstance(name, str) or name not in FUNCTIONS:
    raise CallError(f"unknown function {str(name)[:30]}")
  if not isinstance(args, dict):
    raise CallError("arguments must be an object")
  schema = FUNCTIONS[name]
  missing, extra = set(schema) - set(args), set(args) - set(schema)
  if missing:
    raise CallError(f"missing argument {sorted(missing)[0]}")
  if extra:
    raise CallError(f"unknown argument {str(sorted(extra)[0])[:30]}")
  for k, t in schema.items():
    v = args[k]
    if t == "int" and (not isinstance(v, int) or isinstance(v, bool) or abs(v) > MAX_INT):
      raise CallError(f"{k} must be an integer")
    if t == "str" and (not isinstance(v, str) or len(v) > 40):
      raise CallError(f"{k} must be a short string")
  return name, args


@dataclasses.dataclass
class ApiState:
  """users: name -> {"id", "balance"}; orders: id -> {"user_id", "total", "refunded"}."""

  users: dict
  orders: dict

  def canonical(self) -> str:
    return json.dumps(dataclasses.asdict(self), sort_keys=True)


def execute(state: ApiState, name: str, args: dict) -> dict:
  """Runs a validated call on `state` (in place); CallError for calls that fail on the data."""
  by_id = {u["id"]: n for n, u in state.users.items()}
  if name == "find_user":
    if args["name"] not in state.users:
      raise CallError("no such user")
    return {"user_id": state.users[args["name"]]["id"]}
  if name in ("get_balance", "list_orders"):
    if args["user_id"] not in by_id:
      raise CallError("no such user id")
    if name == "get_balance":
      return {"balance": state.users[by_id[args["user_id"]]]["balance"]}
    return {"order_ids": sorted(int(k) for k, o in state.orders.items()
                                if o["user_id"] == args["user_id"])}
  if name in ("get_order", "refund"):
    order = state.orders.get(str(args["order_id"]))
    if order is None:
      raise CallError("no such order")
    if name == "get_order":
      return dict(order)
    if order["refunded"]:
      raise CallError("order already refunded")
    order["refunded"] = True
    state.users[by_id[order["user_id"]]]["balance"] += order["total"]
    return {"ok": True}
  if name == "transfer":
    a, b, amount = args["from_id"], args["to_id"], args["amount"]
    if a not in by_id or b not in by_id:
      raise CallError("no such user id")
    if amount <= 0 or state.users[by_id[a]]["balance"] < amount:
      raise CallError("amount must be positive and covered by the balance")
    state.users[by_id[a]]["balance"] -= amount
    state.users[by_id[b]]["balance"] += amount
    return {"ok": True}
  raise CallError(f"unknown function {name}")


_PUNCT_GAP = re.compile(r"\s*([{}\[\]:,\"_-])\s*")


def compact(text: str) -> str:
  """Text a word-level tokenizer's `decode` spaced apart, joined back: digits ("1 2" -> "12") and
  JSON punctuation and underscores (`{ " name " : " find _ user " }` -> `{"name":"find_user"}`).
  Exact for this API's calls, whose strings hold no spaces."""
  return _PUNCT_GAP.sub(r"\1", rejoin_digits(text)).strip()


class FunctionCallingTask:
  """The API for `FunctionEnv` (see the module docstring). An example carries `state` (the
  initial `ApiState` as a dict), `expected_state` (None: the task changes nothing) and `answers`
  (None: the task asks for no answer)."""

  def reset(self, example) -> dict:
    for k in ("state", "answers"):
      if k not in example:
        raise ValueError(f"example {example.get('id', '?')!r} has no {k!r}")
    s = example["state"]
    return {"api": ApiState(copy.deepcopy(s["users"]), copy.deepcopy(s["orders"])),
            "expected_state": example.get("expected_state"), "answers": example["answers"]}

  def step(self, state: dict, text: str) -> StepResult:
    kind, call = tool_or_answer(text, (CALL_OPEN, CALL_CLOSE), (ANSWER_OPEN, ANSWER_CLOSE))
    if kind == "answer":
      got = " ".join(compact(call).split())
      want = state["answers"]
      ok_answer = want is None or got in [str(a) for a in want]
      exp = state["expected_state"]
      ok_state = exp is None or state["api"].canonical() == json.dumps(exp, sort_keys=True)
      ok = ok_answer and ok_state
      return StepResult(None, True, float(ok), {"action": "answer", "prediction": got,
                                                "em": float(ok), "state_ok": ok_state})
    if kind == "invalid":
      why = call if call == "unclosed tag" else "no <call> or <answer> action"
      return StepResult(f"{RESP_OPEN} error : {why} {RESP_CLOSE}", False, 0.0,
                        {"action": "invalid", "error": why})
    try:
      name, args = parse_call(compact(call))
      out = execute(state["api"], name, args)
    except CallError as e:
      return StepResult(f"{RESP_OPEN} error : {e} {RESP_CLOSE}", False, 0.0,
                        {"action": "call", "error": str(e)})
    return StepResult(f"{RESP_OPEN} {json.dumps(out)} {RESP_CLOSE}", False, 0.0,
                      {"action": "call", "name": name})


def make_fc_env(max_turns: int = 6) -> FunctionEnv:
  """The function-calling task's `ToolEnv`."""
  return FunctionEnv(FunctionCallingTask(), stop_strings=STOP_STRINGS,
                     observation_close=RESP_CLOSE, max_turns=max_turns)


# ---- the embedded generator --------------------------------------------------------------------

NAMES = ("Mira", "Tobin", "Sela", "Arno", "Kiva", "Dorn", "Lysa", "Benno", "Rhea", "Osric",
         "Pella", "Vance")


def _call(function: str, **args) -> str:
  return json.dumps({"name": function, "arguments": args})


def _state(rng) -> dict:
  names = list(rng.choice(NAMES, size=4, replace=False))
  ids = [int(x) for x in rng.choice(np.arange(10, 99), size=4, replace=False)]
  users = {str(n): {"id": i, "balance": int(rng.integers(2, 40)) * 10} for n, i in zip(names, ids)}
  # Order ids from about a hundred values (100-175): each is one token, and a tiny model copies
  # a token it has seen often (a first version drew from 100-999; the warm start never learned
  # to copy those rarer tokens and wrote other ids).
  orders, oid = {}, int(rng.integers(100, 140))
  for i in ids:
    for _ in range(int(rng.integers(2, 4))):
      oid += int(rng.integers(1, 4))
      orders[str(oid)] = {"user_id": i, "total": int(rng.integers(1, 20)) * 5, "refunded": False}
  return {"users": users, "orders": orders}


def _plan(template: str, state: dict, params: dict, mistake: bool) -> list[tuple[str, str]]:
  """[(thought, call json)] of the expert's solution; the answer is computed by replaying."""
  users = state["users"]
  if template == "balance":  # the mistake: the user id taken for the balance
    n = params["who"]
    steps = [(f"find {n}", _call("find_user", name=n))]
    return steps if mistake else steps + [
        (f"balance of {n}", _call("get_balance", user_id=users[n]["id"]))]
  if template == "transfer":
    a, b = params["from"], params["to"]
    src, dst = (users[b]["id"], users[a]["id"]) if mistake else (users[a]["id"], users[b]["id"])
    return [(f"find {a}", _call("find_user", name=a)), (f"find {b}", _call("find_user", name=b)),
            (f"send from the {'second to the first' if mistake else 'first to the second'}",
             _call("transfer", from_id=src, to_id=dst, amount=params["amount"]))]
  if template == "refund_last":
    n = params["who"]
    uid = users[n]["id"]
    ids = sorted(int(k) for k, o in state["orders"].items() if o["user_id"] == uid)
    target = ids[0] if mistake else ids[-1]
    return [(f"find {n}", _call("find_user", name=n)),
            (f"orders of {n}", _call("list_orders", user_id=uid)),
            (f"refund the {'first' if mistake else 'last'} order",
             _call("refund", order_id=target))]
  if template == "order_total":
    n = params["who"]
    uid = users[n]["id"]
    ids = sorted(int(k) for k, o in state["orders"].items() if o["user_id"] == uid)
    pick = ids[-1] if mistake else ids[0]
    return [(f"find {n}", _call("find_user", name=n)),
            (f"orders of {n}", _call("list_orders", user_id=uid)),
            (f"total of the {'last' if mistake else 'first'} order",
             _call("get_order", order_id=pick))]
  raise ValueError(f"unknown template {template}")


TEMPLATES = ("balance", "transfer", "refund_last", "order_total")


def _task_text(template: str, p: dict) -> str:
  return {"balance": f"what is the balance of {p.get('who')} ?",
          "transfer": f"send {p.get('amount')} from {p.get('from')} to {p.get('to')} , then "
                      f"say done .",
          "refund_last": f"refund the last order of {p.get('who')} , then say done .",
          "order_total": f"what is the total of the first order of {p.get('who')} ?"}[template]


def _final(template: str, responses: list[dict]) -> Optional[str]:
  if template == "balance":
    return str(responses[-1].get("balance", responses[-1].get("user_id")))
  if template == "order_total":
    return str(responses[-1].get("total"))
  return "done"


def replay(problem: "FCProblem", mistake: bool) -> tuple[list[tuple[str, str, str]], str, dict]:
  """The expert's turns [(thought, call, response)], its answer and the final state."""
  api = ApiState(copy.deepcopy(problem.state["users"]), copy.deepcopy(problem.state["orders"]))
  turns, responses = [], []
  for thought, call in _plan(problem.template, problem.state, problem.params, mistake):
    name, args = parse_call(call)
    try:
      out = execute(api, name, args)
    except CallError as e:
      out = {"error": str(e)}
    responses.append(out)
    turns.append((thought, call, json.dumps(out)))
  return turns, _final(problem.template, responses), dataclasses.asdict(api)


@dataclasses.dataclass
class FCProblem:
  id: str
  task: str
  template: str
  params: dict
  state: dict
  answers: Optional[list]
  expected_state: Optional[dict]


@dataclasses.dataclass
class FCWorldConfig:
  seed: int = 0
  n_train: int = 3000
  n_test: int = 400
  expert_rate_range: tuple = (0.2, 0.7)  # of the correct procedure per template, evenly spaced


@dataclasses.dataclass
class FCWorld(ProblemWorld):
  """The generated tasks (`ProblemWorld`); expert_rates: template -> rate of its correct
  procedure."""

  FILE: ClassVar[str] = "fc_world.json"
  GENERATOR: ClassVar[int] = 2  # 2: order ids from 100-175 (the cache of version 1 is not read)
  PROBLEM: ClassVar[type] = FCProblem
  CONFIG: ClassVar[type] = FCWorldConfig


def generate_fc_world(cfg: Optional[FCWorldConfig] = None) -> FCWorld:
  """Tasks of every template on random API states; deterministic in the seed."""
  cfg = cfg or FCWorldConfig()
  rng = np.random.default_rng(cfg.seed)
  k = len(TEMPLATES)
  rates = stratified_rates(rng, k, *cfg.expert_rate_range)
  problems = []
  for i in range(cfg.n_train + cfg.n_test):
    template = TEMPLATES[int(rng.integers(k))]
    state = _state(rng)
    names = list(state["users"])
    a, b = (str(x) for x in rng.choice(names, size=2, replace=False))
    params = {"who": a}
    if template == "transfer":
      params = {"from": a, "to": b,
                "amount": int(rng.integers(1, state["users"][a]["balance"] // 10 + 1)) * 10}
    p = FCProblem(id="", task=_task_text(template, params), template=template, params=params,
                  state=state, answers=None, expected_state=None)
    _, answer, final = replay(p, mistake=False)
    p.answers = [answer]
    if template in ("transfer", "refund_last"):
      p.expected_state = final
    problems.append(p)
  test, train = problems[:cfg.n_test], problems[cfg.n_test:]
  for split, ps in (("train", train), ("test", test)):
    for j, p in enumerate(ps):
      p.id = f"{split}-{j}"
  return FCWorld(cfg, train, test, {t: float(r) for t, r in zip(TEMPLATES, rates)})


def expert_segments(world: FCWorld, p: FCProblem, rng, oracle: bool = False):
  """The expert's solution as [(text, is_generated)] and whether it is right."""
  mistake = (not oracle) and rng.random() >= world.expert_rates[p.template]
  turns, answer, final = replay(p, mistake)
  segs = [(fc_prompt(p.task), False)]
  for thought, call, resp in turns:
    segs.append((f"{THINK_OPEN} {thought} {THINK_CLOSE} {CALL_OPEN} {call} {CALL_CLOSE}", True))
    segs.append((f"{RESP_OPEN} {resp} {RESP_CLOSE}", False))
  segs.append((f"{ANSWER_OPEN} {answer} {ANSWER_CLOSE}", True))
  ok = (answer in p.answers) and (p.expected_state is None or final == p.expected_state)
  return segs, ok


def fc_texts() -> list[str]:
  texts = [fc_prompt(""), "error : unclosed tag no <call> or <answer> action invalid json",
           "a call is an object with name and arguments a call has only name and arguments",
           "unknown function missing argument unknown argument must be an integer",
           "must be a short string no such user no such user id no such order",
           "order already refunded amount must be positive and covered by the balance",
           "call longer than characters arguments must be an object done true false",
           '{ } [ ] : , " ok balance user_id order_ids total refunded name arguments error',
           "from_id to_id amount order_id", " ".join(FUNCTIONS),
           " ".join(a for args in FUNCTIONS.values() for a in args)] + list(NAMES)
  for t in TEMPLATES:
    texts.append(_task_text(t, {"who": "x", "from": "x", "to": "x", "amount": 1}))
  texts += ["find orders of balance of send from the first to the second refund the last order",
            "total of the first order"]
  return texts


MAX_NUMBER_TOKEN = 1000  # every id, amount and balance the generator makes is below it


def build_fc_tokenizer():
  """Word-level tokenizer of the function-calling task: its words, names, JSON punctuation, the
  tags, and each whole number below `MAX_NUMBER_TOKEN` as one token. Ids are copied from
  responses into later calls, and a tiny model copies one token far more reliably than a
  run of digits (a first version spelled numbers digit by digit; its warm start miscopied
  ids in most calls, "5 2 3" written as "5 2 1", whatever the procedure)."""
  from trace_jax.envs.worlds.synthetic_tokenizer import word_tokenizer

  return word_tokenizer(fc_texts() + [" ".join(map(str, range(MAX_NUMBER_TOKEN)))], TAGS)


# ---- real data: BFCL-style JSON ------------------------------------------------------------------


def read_bfcl(path: str, answers_path: Optional[str] = None) -> list[dict]:
  """BFCL-style records from a local JSON or JSONL file: `id`, `question` (a string, or a list
  of chat turns whose user contents are joined), `function` (a list of schemas with `name` and
  `parameters`) and, from the record or from `answers_path` (matched by id), `ground_truth`: a
  list of {function name: {argument: [allowed values]}}. Malformed records raise ValueError
  naming the record."""
  def load(p):
    with open(p, encoding="utf-8") as f:
      text = f.read()
    try:
      data = json.loads(text)
      return data if isinstance(data, list) else [data]
    except json.JSONDecodeError:
      out = []
      for lineno, line in enumerate(text.splitlines(), start=1):
        if line.strip():
          try:
            out.append(json.loads(line))
          except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{lineno}: invalid JSON ({e.msg})") from None
      return out
  records = load(path)
  truth = {r["id"]: r.get("ground_truth") for r in load(answers_path)} if answers_path else {}
  out = []
  for i, r in enumerate(records):
    where = f"{path} record {i + 1}"
    if not isinstance(r, dict) or "question" not in r or "function" not in r:
      raise ValueError(f"{where}: needs question and function")
    q = r["question"]
    if isinstance(q, list):
      turns = [m for turn in q for m in (turn if isinstance(turn, list) else [turn])]
      q = " ".join(m.get("content", "") for m in turns if isinstance(m, dict)
                   and m.get("role") == "user")
    funcs = r["function"] if isinstance(r["function"], list) else [r["function"]]
    if not all(isinstance(f, dict) and "name" in f for f in funcs):
      raise ValueError(f"{where}: every function needs a name")
    rid = str(r.get("id", i))
    out.append(dict(id=rid, question=q, functions=funcs,
                    ground_truth=r.get("ground_truth", truth.get(rid))))
  return out


def calls_match(calls: list[dict], ground_truth: list[dict]) -> bool:
  """Whether `calls` ([{"name", "arguments"}]) match BFCL ground truth, in order: the same
  function names, and every argument among its allowed values (an allowed "" marks an optional
  argument that may be left out)."""
  if not isinstance(ground_truth, list) or len(calls) != len(ground_truth):
    return False
  for call, truth in zip(calls, ground_truth):
    if not isinstance(truth, dict) or len(truth) != 1:
      return False
    (name, allowed), = truth.items()
    if call.get("name") != name or not isinstance(call.get("arguments"), dict):
      return False
    args = call["arguments"]
    for k, values in allowed.items():
      if k not in args:
        if "" not in values:
          return False
      elif args[k] not in values:
        return False
    if set(args) - set(allowed):
      return False
  return True


__all__ = ["ApiState", "CallError", "FCProblem", "FCWorld", "FCWorldConfig", "FUNCTIONS",
           "FunctionCallingTask", "TEMPLATES", "build_fc_tokenizer", "calls_match", "compact",
           "execute", "expert_segments", "fc_prompt", "generate_fc_world", "make_fc_env",
           "parse_call", "read_bfcl", "replay"]
