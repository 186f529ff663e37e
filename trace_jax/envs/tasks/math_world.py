"""Tool-use math: word problems whose arithmetic goes through a calculator, checked by math-verify.

The task (`MathTask`, a `FunctionEnv` task): each turn the policy either calls the calculator,
`<calculate> 40 * ( 100 - 25 ) / 100 </calculate>`, and reads `<result> 30 </result>`, or answers,
`<answer> 30 </answer>`, which ends the rollout with reward 1 when `math_verify` finds it equal to
the gold answer. The calculator is `calculator.calculate` (parsed, never `eval`ed); anything
malformed (an unclosed tag, no action, a refused expression) gets an error observation, never an
exception. Answers sympy could spend unbounded time on (`9**9**9`, `99999!`) are wrong unchecked
(`too_costly`).

The embedded generator (`generate_math_world`) writes problems procedurally from templates, each
a few calculator steps, with an expert that solves them and a *planted systematic mistake* per
template (a discount taken as the price, an area where the perimeter was asked...), made at a
rate drawn per template: as in the lessons world (`lessons_world`), each template is a lesson
RL can learn from contrast, and a tiny model can warm-start on the expert's traces. Numbers are
drawn so every correct step is a whole number. Procedural generators of many task families
exist, but they give problems and answers, not the step-by-step tool calls and the planted
mistakes an imitation warm start needs; these templates give both.

A reader for real data (`read_math_jsonl`): GSM8K/MATH-style JSONL or parquet with a question and
an answer field (GSM8K's "#### 42" final-answer line and MATH's \\boxed{} are both understood).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import threading
from typing import Callable, ClassVar, Optional, Sequence

import numpy as np

from trace_jax.envs.tasks.calculator import CalculatorError, calculate, format_value
from trace_jax.envs.interface import FunctionEnv, StepResult, tool_or_answer
from trace_jax.envs.tasks.problem_world import ProblemWorld, stratified_rates
from trace_jax.envs.worlds.synthetic_tokenizer import rejoin_digits

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALC_OPEN, CALC_CLOSE = "<calculate>", "</calculate>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
TAGS = (THINK_OPEN, THINK_CLOSE, CALC_OPEN, CALC_CLOSE, RESULT_OPEN, RESULT_CLOSE, ANSWER_OPEN,
        ANSWER_CLOSE)
STOP_STRINGS = (CALC_CLOSE, ANSWER_CLOSE)
MAX_ANSWER_CHARS = 64  # longer answers are wrong without parsing them
MAX_GOLD_CHARS = 256  # gold answers (from data files) are bounded too, more loosely
MAX_EXPONENT_DIGITS = 3  # digits in one exponent of an answer (`too_costly`)
MAX_POWER_DIGITS = 5000  # about the most digits a power in an answer may have,
MAX_POWER_TERMS = 100  # and the most terms a symbolic power may expand to (`too_costly`)
VERIFY_TIMEOUT_S = 2  # math-verify's own timeouts, where they work (the main thread)
PROMPT = ("solve the problem . use <calculate> expression </calculate> for arithmetic , then "
          "give <answer> number </answer> .\nproblem : {question}\n")

squash_digits = rejoin_digits  # the name this module's callers use


def math_prompt(question: str) -> str:
  return PROMPT.format(question=question)


# ---- the environment ---------------------------------------------------------------------------


def answers_match(prediction: Optional[str], golds: Sequence[str]) -> bool:
  """Whether `prediction` equals any gold answer under `math_verify` (numbers, fractions, LaTeX);
  None, empty, over-long or too costly predictions are wrong (see `too_costly`), and so are golds
  that are. Never raises and never stalls: whatever goes wrong in the check counts as wrong."""
  if not prediction or len(prediction) > MAX_ANSWER_CHARS:
    return False
  prediction = squash_digits(prediction)
  golds = [str(g) for g in golds if len(str(g)) <= MAX_GOLD_CHARS and not too_costly(str(g))]
  if not golds or too_costly(prediction):
    return False
  from math_verify.errors import TimeoutException  # a BaseException, not an Exception

  try:
    return _verify(prediction, golds)
  except (Exception, TimeoutException):  # noqa: BLE001 - a malformed answer is a wrong one
    logging.getLogger(__name__).debug("answer check failed on %r", prediction, exc_info=True)
    return False


def _verify(prediction: str, golds: list[str]) -> bool:
  from math_verify import parse, verify

  logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout disabled" notice
  # math-verify's timeouts are SIGALRM alarms: only the main thread may set them (elsewhere they
  # raise). They stop slow Python-level work; `too_costly` keeps out what they cannot stop (one
  # huge integer power in C, which holds the GIL), in every thread.
  limit = VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
  pred = parse(prediction, parsing_timeout=limit)
  if not pred:
    return False
  return any(verify(parse(g, parsing_timeout=limit), pred, timeout_seconds=limit) for g in golds)


# Operations whose cost grows with the value of their arguments rather than with the length of the
# text, which sympy would evaluate: factorials, binomials, gamma and zeta, sums, products,
# integrals, limits, `\operatorname{zeros}(n, n)` and its kin, determinants.
_COSTLY = re.compile(r"!|\\(?:[dt]?binom|choose|Gamma|gamma|zeta|sum|prod|i*int|oint|lim|"
                     r"operatorname|det)(?![a-zA-Z])")
# What an exponent may be: a number, a symbol, or a group of those with + - * / . and a few
# commands (`2^{-3}`, `x^{n+1}`, `2^{\frac{1}{3}}`, `e^{i\pi}`); never another power.
_SYMBOLS = r"pi|alpha|beta|theta|phi|tau|omega|circ|prime"
_EXPONENT_TOKEN = re.compile(rf"[+-]?(?:\d+(?:\.\d*)?|\.\d+|[a-zA-Z]|\\(?:{_SYMBOLS})(?![a-zA-Z]))")
_NUMBER = re.compile(r"\d+(?:\.\d*)?|\.\d+")
_EXPONENT_GROUP = re.compile(rf"(?:[\w+\-*/.,(){{}} ]|\\(?:[dt]?frac|cdot|times|left|right|"
                             rf"{_SYMBOLS})(?![a-zA-Z]))*")


def too_costly(text: str) -> bool:
  """Whether checking `text` could cost sympy far more than its length suggests: an operation of
  `_COSTLY`, an exponent that is not a short number, symbol or group of those (no towers such as
  `9**9**9` or `9^{9^9}`), more than MAX_EXPONENT_DIGITS digits in one exponent, or a power too
  large. A power's size is its base's size times its exponent (a symbol or small expression
  counts as 10 ** its digits): a number's size is its digits, a bracketed base's the largest size
  met so far at its level (`(9^99)^99` is 99 * 99), and the result must stay under about
  MAX_POWER_DIGITS digits; a base with s symbols raised to e expands to up to e ** s terms, which
  must stay under MAX_POWER_TERMS (`(x+y+z)^{99}`)."""
  t = re.sub(r"\s+", "", text).replace("\\!", "")  # `* *` is read as `**`; `\!` is a space
  if _COSTLY.search(t):
    return True
  t = t.replace("**", "^")
  levels = [1]  # per open bracket: the largest power size inside it so far
  i = 0
  while i < len(t):
    ch = t[i]
    if ch in "{([":
      levels.append(1)
    elif ch in "})]":
      inner = levels.pop() if len(levels) > 1 else 1
      levels[-1] = max(levels[-1], inner)
    elif ch == "^":
      base, symbols = _base_size(t, i, levels[-1])
      weight, i = _exponent_weight(t, i + 1)
      if weight is None:
        return True
      size = base * weight ** max(symbols, 1)
      if size > (MAX_POWER_TERMS if symbols else MAX_POWER_DIGITS):
        return True
      levels[-1] = max(levels[-1], size)
      continue
    i += 1
  return False


def _base_size(t: str, caret: int, level: int) -> tuple[int, int]:
  """(size, symbols) of the base of the power at `t[caret]` (see `too_costly`)."""
  if caret and t[caret - 1] in "})]":
    depth, j = 0, caret - 1
    while j >= 0:
      depth += (t[j] in "})]") - (t[j] in "{([")
      if depth == 0:
        break
      j -= 1
    group = re.sub(r"\\[a-zA-Z]+", "", t[max(j, 0):caret])  # commands are not symbols
    return level, len({c for c in group if c.isalpha()})
  if re.search(r"(?<!\\)\b[a-zA-Z]$", t[:caret]):  # one symbol: x^2
    return 1, 1
  return max(1, sum(c.isdigit() for c in re.search(r"[\d.]*$", t[:caret]).group())), 0


def _exponent_weight(t: str, start: int) -> tuple[Optional[int], int]:
  """(weight, end) of the exponent at `t[start:]`: a number weighs itself (at least 2), a symbol or
  small expression 10 ** its digits; None when the exponent is not allowed (`too_costly`)."""
  if t[start:start + 1] in ("{", "("):
    end = _group_end(t, start)
    if end < 0 or not _EXPONENT_GROUP.fullmatch(t[start + 1:end]):
      return None, start
    exponent, end = t[start + 1:end], end + 1
  else:
    m = _EXPONENT_TOKEN.match(t, start)
    if not m:
      return None, start
    exponent, end = m.group(), m.end()
  digits = sum(ch.isdigit() for ch in exponent)
  if digits > MAX_EXPONENT_DIGITS or t.startswith("^", end):  # a tower: x^a^b
    return None, start
  literal = exponent.lstrip("+-")
  return (max(2, int(float(literal))) if _NUMBER.fullmatch(literal) else 10 ** digits), end


def _group_end(text: str, start: int) -> int:
  """The index of the bracket closing the one at `text[start]`, -1 when it is not closed."""
  depth = 0
  for j in range(start, len(text)):
    depth += text[j] in "{(["
    depth -= text[j] in "})]"
    if depth == 0:
      return j
  return -1


class MathTask:
  """Calculator and answer checking for `FunctionEnv` (see the module docstring). The example's
  `answers` are the gold answers."""

  def __init__(self):
    self.counters = dict(calculations=0, calculator_errors=0, answers=0, invalid_actions=0)

  def reset(self, example) -> dict:
    golds = example.get("answers")
    if not golds:
      raise ValueError(f"example {example.get('id', '?')!r} has no 'answers'")
    return {"golds": [str(g) for g in golds]}

  def step(self, state: dict, text: str) -> StepResult:
    kind, expr = tool_or_answer(text, (CALC_OPEN, CALC_CLOSE), (ANSWER_OPEN, ANSWER_CLOSE))
    if kind == "answer":
      self.counters["answers"] += 1
      ok = answers_match(expr.strip(), state["golds"])
      return StepResult(None, True, float(ok), {"action": "answer", "prediction": expr.strip(),
                                                "em": float(ok)})
    if kind == "invalid":
      self.counters["invalid_actions"] += 1
      why = expr if expr == "unclosed tag" else "no <calculate> or <answer> action"
      return StepResult(f"{RESULT_OPEN} error : {why} {RESULT_CLOSE}", False, 0.0,
                        {"action": "invalid", "error": why})
    self.counters["calculations"] += 1
    try:
      value = format_value(calculate(squash_digits(expr)))
    except (CalculatorError, ArithmeticError, ValueError, RecursionError, MemoryError) as e:
      # CalculatorError explains itself; anything else the calculator let through is still the
      # policy's malformed input, never the run's failure.
      e = e if isinstance(e, CalculatorError) else CalculatorError("not an arithmetic expression")
      self.counters["calculator_errors"] += 1
      return StepResult(f"{RESULT_OPEN} error : {e} {RESULT_CLOSE}", False, 0.0,
                        {"action": "calculate", "error": str(e)})
    return StepResult(f"{RESULT_OPEN} {value} {RESULT_CLOSE}", False, 0.0,
                      {"action": "calculate", "value": value})


def make_math_env(max_turns: int = 6) -> FunctionEnv:
  """The math task's `ToolEnv`."""
  return FunctionEnv(MathTask(), stop_strings=STOP_STRINGS, observation_close=RESULT_CLOSE,
                     max_turns=max_turns)


# ---- the embedded generator --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Template:
  """A problem family: `draw(rng)` gives (numbers dict, question text); `solve(numbers, mistake)`
  gives the steps [(what the step is, expression)] of the correct method or of the planted
  mistake."""

  name: str
  draw: Callable
  solve: Callable


def _shirts(rng):
  price, off, n = int(rng.integers(1, 11)) * 20, int(rng.choice([10, 20, 25, 50, 75])), \
      int(rng.integers(2, 9))
  return dict(price=price, off=off, n=n), (
      f"a shirt costs {price} dollars . it is {off} percent off . how many dollars do {n} "
      f"shirts cost ?")


def _shirts_solve(x, mistake):
  one = (f"{x['price']} * {x['off']} / 100" if mistake
         else f"{x['price']} * ( 100 - {x['off']} ) / 100")
  return [("price of one shirt", one), ("price of all shirts", "{0} * " + str(x["n"]))]


def _train(rng):
  h = int(rng.integers(2, 6))
  speed, t = int(rng.integers(3, 20)) * 5, int(rng.integers(2, 9))
  return dict(dist=speed * h, h=h, t=t), (
      f"a train goes {speed * h} km in {h} hours . how many km does it go in {t} hours ?")


def _train_solve(x, mistake):
  rate = f"{x['dist']} * {x['h']}" if mistake else f"{x['dist']} / {x['h']}"
  return [("km per hour", rate), ("km in the new time", "{0} * " + str(x["t"]))]


def _fence(rng):
  a, b, c = int(rng.integers(3, 30)), int(rng.integers(3, 30)), int(rng.integers(2, 9))
  return dict(a=a, b=b, c=c), (
      f"a garden is {a} m long and {b} m wide . a fence costs {c} dollars per m . how many "
      f"dollars does a fence around the garden cost ?")


def _fence_solve(x, mistake):
  edge = f"{x['a']} * {x['b']}" if mistake else f"2 * ( {x['a']} + {x['b']} )"
  return [("length of the fence", edge), ("cost of the fence", "{0} * " + str(x["c"]))]


def _savings(rng):
  a, w = int(rng.integers(2, 30)), int(rng.integers(3, 12))
  b = int(rng.integers(1, a * w))
  return dict(a=a, w=w, b=b), (
      f"sam saves {a} dollars a week for {w} weeks and then spends {b} dollars . how many "
      f"dollars are left ?")


def _savings_solve(x, mistake):
  saved = f"{x['a']} + {x['w']}" if mistake else f"{x['a']} * {x['w']}"
  return [("dollars saved", saved), ("dollars left", "{0} - " + str(x["b"]))]


def _ages(rng):
  a, b, c = int(rng.integers(3, 40)), int(rng.integers(1, 20)), int(rng.integers(1, 15))
  return dict(a=a, b=b, c=c), (
      f"ann is {a} years old . bob is {b} years older than twice ann 's age . how old will bob "
      f"be in {c} years ?")


def _ages_solve(x, mistake):
  bob = f"2 * ( {x['a']} + {x['b']} )" if mistake else f"2 * {x['a']} + {x['b']}"
  return [("bob 's age now", bob), ("bob 's age later", "{0} + " + str(x["c"]))]


def _boxes(rng):
  per, boxes, eaten = int(rng.integers(3, 15)), int(rng.integers(2, 12)), int(rng.integers(2, 6))
  kids = int(rng.integers(2, 6))
  total = per * boxes - eaten
  eaten += total % kids  # the rest shares evenly
  return dict(per=per, boxes=boxes, eaten=eaten, kids=kids), (
      f"a box holds {per} cookies . there are {boxes} boxes . {eaten} cookies are eaten and "
      f"the rest is shared by {kids} kids . how many cookies does each kid get ?")


def _boxes_solve(x, mistake):
  return [("cookies in all boxes", f"{x['per']} * {x['boxes']}"),
          ("cookies left", "{0} - " + str(x["eaten"])),
          ("cookies per kid", "{1} / " + str(x["kids"]) if not mistake
           else "{1} * " + str(x["kids"]))]


TEMPLATES = (Template("shirts", _shirts, _shirts_solve), Template("train", _train, _train_solve),
             Template("fence", _fence, _fence_solve), Template("savings", _savings, _savings_solve),
             Template("ages", _ages, _ages_solve), Template("boxes", _boxes, _boxes_solve))


@dataclasses.dataclass
class MathWorldConfig:
  seed: int = 0
  n_train: int = 4000
  n_test: int = 500
  # The expert's rate of the correct method per template: evenly spaced over this range, paired
  # with templates at random (as the lessons world's expert rates).
  expert_rate_range: tuple = (0.2, 0.7)


@dataclasses.dataclass
class MathProblem:
  id: str
  question: str
  answers: list
  template: str
  numbers: dict


@dataclasses.dataclass
class MathWorld(ProblemWorld):
  """The generated problems (`ProblemWorld`); expert_rates: template -> rate of its correct
  method."""

  FILE: ClassVar[str] = "math_world.json"
  PROBLEM: ClassVar[type] = MathProblem
  CONFIG: ClassVar[type] = MathWorldConfig


def solution(template: Template, numbers: dict, mistake: bool) -> list[tuple[str, str, str]]:
  """[(what, expression, value)] of a method, earlier values filled into later expressions."""
  values, out = [], []
  for what, expr in template.solve(numbers, mistake):
    expr = expr.format(*values)
    v = format_value(calculate(expr))
    values.append(v)
    out.append((what, expr, v))
  return out


def generate_math_world(cfg: Optional[MathWorldConfig] = None) -> MathWorld:
  """Problems of every template (drawn evenly), deduplicated, split into train and held-out;
  deterministic in the seed."""
  cfg = cfg or MathWorldConfig()
  rng = np.random.default_rng(cfg.seed)
  k = len(TEMPLATES)
  rates = stratified_rates(rng, k, *cfg.expert_rate_range)
  problems, seen = [], set()
  want = cfg.n_train + cfg.n_test
  attempts = 0
  while len(problems) < want and attempts < 50 * want:
    attempts += 1
    t = TEMPLATES[int(rng.integers(k))]
    numbers, question = t.draw(rng)
    if question in seen:
      continue
    seen.add(question)
    answer = solution(t, numbers, mistake=False)[-1][2]
    problems.append(MathProblem(id="", question=question, answers=[answer], template=t.name,
                                numbers=numbers))
  order = rng.permutation(len(problems))
  test = [problems[i] for i in order[:cfg.n_test]]
  train = [problems[i] for i in order[cfg.n_test:]]
  for split, ps in (("train", train), ("test", test)):
    for i, p in enumerate(ps):
      p.id = f"{split}-{i}"
  return MathWorld(cfg, train, test, {t.name: float(r) for t, r in zip(TEMPLATES, rates)})


def expert_segments(world: MathWorld, problem: MathProblem, rng: np.random.Generator,
                    oracle: bool = False) -> tuple[list[tuple[str, bool]], bool]:
  """The expert's solution as [(text, is_generated)] (prompt, turns, results) and whether its
  answer is right: the template's correct method at its expert rate, else the planted mistake
  (`oracle`: always correct). The results are the calculator's own."""
  template = next(t for t in TEMPLATES if t.name == problem.template)
  mistake = (not oracle) and rng.random() >= world.expert_rates[problem.template]
  steps = solution(template, problem.numbers, mistake)
  segs = [(math_prompt(problem.question), False)]
  for what, expr, value in steps:
    segs.append((f"{THINK_OPEN} {what} {THINK_CLOSE} {CALC_OPEN} {expr} {CALC_CLOSE}", True))
    segs.append((f"{RESULT_OPEN} {value} {RESULT_CLOSE}", False))
  answer = steps[-1][2]
  segs.append((f"{THINK_OPEN} the answer is {answer} {THINK_CLOSE} {ANSWER_OPEN} {answer} "
               f"{ANSWER_CLOSE}", True))
  return segs, answer == problem.answers[0]


def math_texts(world: MathWorld) -> list[str]:
  """Every text the task, its prompts and its expert write (for the tokenizer's vocabulary)."""
  texts = [math_prompt(""), "error : the answer is", "unclosed tag",
           "no <calculate> or <answer> action", "only numbers and + - * / // % ** ( ) are "
           "allowed", "division by zero", "number too large", "result too precise",
           "expression nested too deeply", "empty expression", "not an arithmetic expression",
           "exponent must be a whole number up to", "expression longer than characters",
           "expected text", "not a number", ". -"]
  rng = np.random.default_rng(0)
  for t in TEMPLATES:
    numbers, question = t.draw(rng)
    texts.append(question)
    for mistake in (False, True):
      texts += [what for what, _, _ in solution(t, numbers, mistake)]
  return texts


def build_math_tokenizer(world: MathWorld):
  """Word-level tokenizer of the math task: its words, single digits, operators and the tags."""
  from trace_jax.envs.worlds.synthetic_tokenizer import word_tokenizer

  return word_tokenizer(math_texts(world) + ["( ) * / + - % ."], TAGS, digits=True)


# ---- real data -----------------------------------------------------------------------------------

_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")


def final_answer(solution_text: str) -> Optional[str]:
  """The final answer of a GSM8K ("... #### 42") or MATH ("... \\boxed{42}") solution."""
  if "####" in solution_text:
    return solution_text.rsplit("####", 1)[1].strip().replace(",", "")
  boxed = _BOXED.findall(solution_text)
  return boxed[-1].strip() if boxed else None


def read_math_jsonl(path: str) -> list[MathProblem]:
  """GSM8K/MATH-style records from a local JSONL or parquet file: a `question` (or `problem`)
  field and an `answer` (or `solution`) field holding the worked solution or the bare answer.
  Records without a recoverable answer raise ValueError naming the line."""
  if path.endswith(".parquet"):
    import pyarrow.parquet as pq
    records = pq.read_table(path).to_pylist()
  else:
    records = []
    with open(path, encoding="utf-8") as f:
      for lineno, line in enumerate(f, start=1):
        if line.strip():
          try:
            records.append(json.loads(line))
          except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
  out = []
  for i, r in enumerate(records):
    q = r.get("question", r.get("problem"))
    sol = r.get("answer", r.get("solution"))
    if not isinstance(q, str) or not isinstance(sol, str):
      raise ValueError(f"{path} record {i + 1}: needs string fields question/problem and "
                       f"answer/solution")
    ans = final_answer(sol) or (sol.strip() if len(sol.strip()) <= MAX_ANSWER_CHARS else None)
    if not ans:
      raise ValueError(f"{path} record {i + 1}: no final answer (#### or \\boxed{{}}) found")
    out.append(MathProblem(id=str(r.get("id", i)), question=q, answers=[ans], template="real",
                           numbers={}))
  return out


__all__ = ["MathProblem", "MathTask", "MathWorld", "MathWorldConfig", "TEMPLATES",
           "answers_match", "build_math_tokenizer", "expert_segments", "final_answer",
           "generate_math_world", "make_math_env", "math_prompt", "read_math_jsonl",
           "solution", "squash_digits", "too_costly"]
