"""Reward functions: user files, failure-safe scoring with a timeout, and a math answer checker.

A user reward file defines `reward(prompt, response, **fields)` (or a class with __call__, built
with no arguments) returning a float, or a dict of named floats that `weights` combines. `fields`
are the prompt record's other fields (e.g. "answer"); a function that does not take **kwargs only
receives the fields it names.

Every score goes through `score_safely`: an exception, a timeout, or a result that is not a finite
number marks the sample failed (score None and a one-line reason) instead of killing the node.
"""

from __future__ import annotations

from dataflow.errors import UserError

import functools
import importlib.util
import inspect
import logging
import math
import numbers
import os
import re
import string
import threading
import traceback
from typing import Any, Callable

logger = logging.getLogger(__name__)


class RewardLoadError(UserError, ValueError):
    """A reward file that cannot be used; the message names the file (and line)."""


class RewardTimeout(TimeoutError):
    pass


# ---------------------------------------------------------------------------------------------
# Loading user reward files
# ---------------------------------------------------------------------------------------------

class RewardFn:
    """A loaded reward: call it as fn(prompt, response, **fields) -> float.

    Dict results are combined as sum(weights[k] * value[k]). With weights configured, the keys
    must match them exactly (a typo would otherwise silently drop a component); with no weights
    (None or {}) every component has weight 1.
    """

    def __init__(self, fn: Callable, weights: dict[str, float] | None = None, source: str = ""):
        self.fn = fn
        self.weights = dict(weights) if weights else None
        self.source = source
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):               # e.g. a builtin: pass every field
            params = [inspect.Parameter("fields", inspect.Parameter.VAR_KEYWORD)]
        self._takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        self._names = {p.name for p in params}

    def __call__(self, prompt: str, response: str, **fields) -> float:
        if not self._takes_all:
            fields = {k: v for k, v in fields.items() if k in self._names}
        return self.combine(self.fn(prompt, response, **fields))

    def combine(self, value: Any) -> Any:
        """A dict result -> its weighted sum; anything else is returned unchanged."""
        if not isinstance(value, dict):
            return value
        where = f"{self.source}: " if self.source else ""
        if self.weights is not None and set(value) != set(self.weights):
            raise ValueError(f"{where}reward returned keys {sorted(value)} but weights has "
                             f"{sorted(self.weights)}; make them match")
        for key, v in value.items():
            if not _is_finite_number(v):
                raise ValueError(f"{where}component {key!r} is {v!r}, not a finite number")
        weights = self.weights or {}
        return sum(weights.get(k, 1.0) * float(v) for k, v in value.items())


def load_reward_fn(path: str, name: str | None = None,
                   weights: dict[str, float] | None = None) -> RewardFn:
    """Load `name` (default "reward") from a Python file as a RewardFn.

    Raises RewardLoadError naming the file: missing file, syntax error (with its line), an
    exception while importing, no such function/class (listing the callables it defines), or a
    class that cannot be built with no arguments.
    """
    name = name or "reward"
    if not os.path.isfile(path):
        raise RewardLoadError(f"{path}: reward file does not exist")
    with open(path, encoding="utf-8") as f:
        source = f.read()
    try:
        compile(source, path, "exec")
    except SyntaxError as e:
        raise RewardLoadError(f"{path}:{e.lineno}: syntax error: {e.msg}") from None
    module_name = "user_reward_" + re.sub(r"\W", "_", os.path.abspath(path))
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        line = _innermost_line(e, path)
        raise RewardLoadError(f"{path}{line}: importing it raised {type(e).__name__}: {e}") from e
    obj = getattr(module, name, None)
    if obj is None or not callable(obj):
        defined = sorted(k for k, v in vars(module).items()
                         if callable(v) and not k.startswith("_")
                         and getattr(v, "__module__", None) == module_name)
        raise RewardLoadError(f"{path}: no function or class named {name!r}; it defines "
                              f"{defined or 'no callables'}; pass name=... or rename it")
    if inspect.isclass(obj):
        try:
            obj = obj()
        except Exception as e:
            raise RewardLoadError(f"{path}: building class {name}() with no arguments raised "
                                  f"{type(e).__name__}: {e}") from e
    return RewardFn(obj, weights, source=path)


def _innermost_line(exc: BaseException, path: str) -> str:
    """":<line>" of the deepest traceback frame inside `path`, or ""."""
    lines = [fr.lineno for fr in traceback.extract_tb(exc.__traceback__)
             if os.path.abspath(fr.filename) == os.path.abspath(path)]
    return f":{lines[-1]}" if lines else ""


# ---------------------------------------------------------------------------------------------
# Failure-safe scoring
# ---------------------------------------------------------------------------------------------

def call_with_timeout(fn: Callable, args: tuple = (), kwargs: dict | None = None,
                      timeout_s: float | None = None) -> Any:
    """fn(*args, **kwargs), raising RewardTimeout if it has not returned after timeout_s.

    Runs fn in a fresh daemon thread and joins it with a timeout. Python cannot kill a thread:
    a hung call is ABANDONED and keeps running (holding memory, competing for the GIL if it
    spins) until it returns or the process exits; being a daemon it never blocks exit.
    timeout_s=None calls fn directly. Cost measured on the 2-core VM: ~0.1-0.5 ms per call
    (direct call ~1 us); the alternatives were a forked process per call (~13 ms) or a process
    pool (~0.5 ms round trip, but a hung worker must be killed and respawned, and arguments and
    the function must pickle), so threads it is; use a reward server for untrusted code.
    """
    kwargs = kwargs or {}
    if timeout_s is None:
        return fn(*args, **kwargs)
    box: dict = {}

    def target():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True, name="reward-call")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise RewardTimeout(f"timed out after {timeout_s:g}s (call abandoned)")
    if "error" in box:
        raise box["error"]
    return box["value"]


_logged_failures: set = set()


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and math.isfinite(float(value))


def score_safely(fn: Callable, prompt: str, response: str, fields: dict | None = None,
                 timeout_s: float | None = None) -> tuple[float | None, str | None]:
    """(score, None) on success, (None, one-line reason) if the sample failed.

    Failure = fn raised, ran past timeout_s, or returned something that is not a finite real
    number (NaN, inf, a string, None...). "prompt"/"response" keys in `fields` are dropped. The
    full traceback of an exception is logged once per distinct (type, place), not per sample.
    """
    kwargs = {k: v for k, v in (fields or {}).items() if k not in ("prompt", "response")}
    try:
        value = call_with_timeout(fn, (prompt, response), kwargs, timeout_s)
    except RewardTimeout as e:
        return None, str(e)
    except Exception as e:
        frames = traceback.extract_tb(e.__traceback__)
        place = (frames[-1].filename, frames[-1].lineno) if frames else None
        key = (type(e).__name__, place)
        if key not in _logged_failures and len(_logged_failures) < 1000:
            _logged_failures.add(key)
            logger.warning("reward function failed (logged once per kind):\n%s",
                           "".join(traceback.format_exception(e)))
        reason = f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__
        return None, reason[:300]
    if not _is_finite_number(value):
        return None, f"returned {type(value).__name__} {value!r:.80}, expected a finite float"
    return float(value), None


# ---------------------------------------------------------------------------------------------
# Math answer checker
# ---------------------------------------------------------------------------------------------

_NUMBER = r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?"
_ALLOWED_NAMES = {"sqrt", "pi", "sin", "cos", "tan", "log", "ln", "exp", "oo"}
_MAX_EXPONENT = 1000


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), with nested braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[i:j - 1] if depth == 0 else None


def extract_answer(text: str) -> str | None:
    """The final answer in a response: last \\boxed{...}; else what follows the last
    "answer is"/"answer:"/"####" up to the end of its line; else the last number; else None."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    marked = re.findall(r"(?:answer\s*(?:is|:)|####)\s*:?\s*([^\n]+)", text, flags=re.IGNORECASE)
    if marked:
        return marked[-1].strip().rstrip(".").strip()
    numbers_found = re.findall(_NUMBER, text)
    return numbers_found[-1].strip() if numbers_found else None


def _normalize(ans: str) -> str:
    """Plain-text form of a LaTeX-ish answer: no $, \\left, spacing commands, "x =" prefix."""
    s = ans.strip().strip("$").strip()
    s = re.sub(r"\\(left|right|displaystyle|!|,|;|quad)", "", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\\text\{[^{}]*\}", "", s)
    s = re.sub(r"^[A-Za-z]\s*=\s*", "", s)          # "x = 3" -> "3"
    s = re.sub(r"(\d),(\d{3})\b", r"\1\2", s)        # 1,000 -> 1000
    return s.rstrip(".").strip()


def _latex_to_plain(s: str) -> str:
    for _ in range(10):                               # innermost \frac / \sqrt first
        new = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", s)
        new = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", new)
        if new == s:
            break
        s = new
    s = s.replace("\\cdot", "*").replace("\\times", "*").replace("\\pi", "pi").replace("\\ln", "ln")
    s = s.replace("\\infty", "oo").replace("{", "(").replace("}", ")")
    return s


def _to_sympy(ans: str):
    """A sympy expression for `ans`, or None if it is not a small, safe arithmetic expression.

    Safety: parse_expr evaluates generated Python, so the text is first restricted to digits,
    letters, + - * / ^ ( ) . and spaces, names to single letters and _ALLOWED_NAMES (no "_", no
    attribute access), and parsed unevaluated so a power tower can be rejected (exponents above
    _MAX_EXPONENT) before sympy computes it.
    """
    import sympy
    from sympy.parsing.sympy_parser import (convert_xor, implicit_multiplication_application,
                                            parse_expr, standard_transformations)
    s = _latex_to_plain(ans)
    if len(s) > 200 or not re.fullmatch(r"[0-9A-Za-z+\-*/^().\s]+", s):
        return None
    if re.search(r"[A-Za-z]\s*\.|\.\s*[A-Za-z]", s):
        return None
    if any(len(w) > 1 and w not in _ALLOWED_NAMES for w in re.findall(r"[A-Za-z]+", s)):
        return None
    local = {c: sympy.Symbol(c) for c in string.ascii_letters if c not in "EI"}
    local.update(ln=sympy.log, pi=sympy.pi, oo=sympy.oo)
    transformations = standard_transformations + (implicit_multiplication_application, convert_xor)
    try:
        expr = parse_expr(s, local_dict=local, transformations=transformations, evaluate=False)
    except Exception:
        return None
    try:
        for node in sympy.preorder_traversal(expr):
            if isinstance(node, sympy.Pow) and node.exp.is_number:
                if not abs(complex(node.exp.evalf())) <= _MAX_EXPONENT:
                    return None
    except (OverflowError, TypeError, ValueError):
        return None
    return expr


def _equal_uncached(pred: str, ref: str) -> bool:
    import sympy
    a, b = _to_sympy(pred), _to_sympy(ref)
    if a is None or b is None:
        return False
    a, b = a.doit(), b.doit()
    if not a.free_symbols and not b.free_symbols:
        x, y = complex(a.evalf()), complex(b.evalf())
        return abs(x - y) <= 1e-6 * max(1.0, abs(y))
    return sympy.simplify(a - b) == 0


@functools.lru_cache(maxsize=16384)
def answers_equal(pred: str, ref: str, timeout_s: float = 2.0) -> bool:
    """Whether two final answers are equal: same normalized text, or numerically equal
    (rel. 1e-6), or symbolically equal (simplify(a - b) == 0). Cached; a comparison that runs
    past timeout_s counts as unequal (and is cached as such, so it is not retried)."""
    pred, ref = _normalize(pred), _normalize(ref)
    if pred == ref:
        return True
    # Import sympy (seconds on a loaded machine) before the clock starts: the timeout bounds the
    # comparison, not the first call's import.
    import sympy.parsing.sympy_parser  # noqa: F401
    try:
        return bool(call_with_timeout(_equal_uncached, (pred, ref), timeout_s=timeout_s))
    except Exception:
        return False


def math_reward(prompt: str, response: str, answer: str, **fields) -> float:
    """1.0 if the response's final answer (extract_answer) equals `answer`, else 0.0.

    `answer` may itself be LaTeX or contain \\boxed{...}. Extra fields are ignored.
    """
    pred = extract_answer(response)
    if pred is None:
        return 0.0
    ref = _last_boxed(answer) or str(answer)
    return 1.0 if answers_equal(pred, ref) else 0.0
