"""Rewards: final-answer extraction, numeric normalisation, and reward functions registered by name.

A reward function maps (completion text, ground-truth answer) to a float. Register one with
`@register("name")`; the config's `reward.functions` lists names and `reward.weights` their
weights, and the trainer sums them.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from fractions import Fraction

RewardFn = Callable[[str, str], float]

_REGISTRY: dict[str, RewardFn] = {}

# A minus sign right after a digit is a range or a difference ("2-3 days"), not a negative number.
# Commas only as thousands separators: "2,5" is two numbers.
_NUMBER = r"(?<!\d)-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+)?|(?<!\d)-?\.\d+"
# "The answer is: **12**", "answer is $\\(12\\)$", "answer is \\$12": markdown emphasis, math delimiters and an
# escaped dollar may come before the answer. The answer: a mixed number (3 1/2) or one with blanks between thousands
# (1 000); a number with the LaTeX that follows it (2\sqrt{3}, not the 2 alone); LaTeX (\frac{3}{4}; \sqrt{2},
# which no number equals, rather than the 2 inside it); a choice, (B) or a capital letter, or yes / no / true /
# false, the last two kinds only where the sentence ends ("the answer is no longer 5" states no answer).
_BRACED = r"\{(?:[^{}]|\{[^{}]*\})*\}"  # one level of nesting: \frac{\sqrt{3}}{2}
_LATEX = r"-?\\[a-zA-Z]+(?:" + _BRACED + r"|\d)*"
_ENDS = r"(?=\*\*|\$|\\[)\]]|[.,;!]?(?:\s*$|\s*\n)|[.,;!]\s)"
_STATED = "|".join([
    r"-?\d+\s+\d+/\d+(?![\d/])", r"-?\d{1,3}(?: \d{3})+(?:\.\d+)?(?!\d)",
    "(?:" + _NUMBER + r")(?:\\[a-zA-Z]+(?:" + _BRACED + r"|\d)*)*", _LATEX,
    r"\([A-Ea-e]\)", r"(?-i:[A-E])" + _ENDS, r"(?:yes|no|true|false)" + _ENDS,
])
# The colon's blanks are their own group: "\s*:?" before a group that also takes blanks split a run of n blanks
# n ways, and a degenerate completion ("answer is" + 16k blanks) backtracked for 20 s.
_ANSWER_IS = re.compile(r"answer is(?:\s*:)?(?:[\s*_$]|\\[(\[$])*(" + _STATED + ")", re.IGNORECASE)
_WRAPPER = r"\\(?:text|textbf|mathrm|mathbf)\{([^{}]*)\}"  # \text{7} is 7, \textbf{yes} is yes
# A unit after the number (12\text{ cm}, 30^\circ, 30^{\circ}, 30°), dropped; only at the end: 2\text{ and }5 is not 25.
_UNIT = re.compile(r"(?:" + _WRAPPER + r"|\^(?:\\circ|\{\\circ\})|\u00b0)$")
_LAST_NUMBER = re.compile(r"-?(?:\d+\s*)?\\[dt]?frac\{-?\d+\}\{\d+\}|" + _NUMBER)  # \frac{3}{4}: not its 4; 3\frac{1}{2} whole
# verl gsm8k strict: the number after the last "####", alone to its line's end (not a heading's "#### 1. Setup")
_GSM8K = re.compile(r"####[ \t]*\\?\$?(" + _NUMBER + r")[ \t]*\.?[ \t]*$", re.M)


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: makes `fn(completion, answer) -> float` available as reward `name`."""

    def add(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"reward {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return add


def get(name: str) -> RewardFn:
    """A registered reward, or `package.module:function` imported (so a config can name user code)."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"reward {name!r}: cannot import {attr} from {module} ({e})") from e
    raise ValueError(
        f"unknown reward {name!r}; registered rewards: {', '.join(sorted(_REGISTRY))} "
        "(or name your own function as package.module:function)"
    )


def registered() -> list[str]:
    return sorted(_REGISTRY)


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a completion: the last \\boxed{}, else the number after the last "####" (verl's gsm8k
    format), else the last "The answer is X", else the last number in the text (verl gsm8k's flexible mode; its math
    and strict modes give such a completion 0); None when there is none. A Unicode minus (U+2212) is a minus."""
    text = text.replace("\u2212", "-")
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    marked = _GSM8K.findall(text)
    if marked:
        return marked[-1]
    stated = _ANSWER_IS.findall(text)
    if stated:
        return stated[-1]
    numbers = _LAST_NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalize_number(text: str | None) -> Fraction | None:
    """'1,234', '$12.50', '\\$12.50', '3/4', '\\frac{3}{4}', '\\tfrac34', '50\\%', '\\text{7}', '30^\\circ', '-0.5', '\u22120.5',
    '7.', 'x = 7' -> an exact Fraction; None if not a number ('2,5' and '3 4' are two numbers, not one)."""
    if text is None:
        return None
    s = re.sub(r"\\[!,;: ]", "", text.strip().rstrip(".")).replace("{,}", "")  # LaTeX spacing: 1\,000, 1{,}000
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s.replace("\u2212", "-"))  # x = 5: one variable's value; U+2212 minus
    mixed = re.fullmatch(r"(-?)(\d+)(?:\s+(\d+/\d+)|\s*(\\[dt]?frac.*))", s)
    if mixed:  # 1 1/2, 3\frac{1}{2}: a whole part and a fraction (not 11/2, nor the 3 alone)
        sign, whole, fraction = mixed.group(1), mixed.group(2), mixed.group(3) or mixed.group(4)
        part = normalize_number(fraction)
        if part is None or part < 0 or len(whole) > 4000:  # a looping completion's digits: int() refuses > 4300
            return None
        return (-1 if sign else 1) * (int(whole) + part)
    if re.search(r"\d(?:\s+\d+/\d|\s*\\[dt]?frac)", s):  # a mixed number among other text
        return None
    s = re.sub(r"\\([$%])", r"\1", s).replace("$", "")  # \$12.50, 50\%
    # Commas and spaces only as thousands separators (1,234 and 1 234): "2,5" and "3 4" are two numbers, not 25 and 34.
    s = re.sub(r"(?<=\d)[, ](?=\d{3}(?!\d))", "", re.sub(r"\s+", " ", s))
    s = re.sub(r"(?<!\d) | (?!\d)", "", s)
    whole = re.fullmatch(_WRAPPER, s)  # \text{7} is 7; 12\text{ cm} is 12
    s = whole.group(1) if whole else _UNIT.sub("", s)
    frac = re.fullmatch(r"(-?)\\[dt]?frac(?:\{(-?\d+)\}\{(\d+)\}|(\d)(\d))", s)  # \frac{3}{4}, \tfrac34
    if frac:
        sign, num, den = frac.group(1), frac.group(2) or frac.group(4), frac.group(3) or frac.group(5)
        s = f"{sign}{num}/{den}"
    s = s.rstrip("%")
    if not re.fullmatch(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:/\d+)?", s):  # Fraction() would build 1e10000000 exactly
        return None
    try:
        value = Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return value


def answers_match(predicted: str | None, truth: str) -> bool:
    """Numerically equal when both parse as numbers, else equal as text without its typesetting (_canonical: as
    verl's strip_string, blanks and \\left / \\right do not count); a blank truth matches nothing. A ground truth
    holding "####" is a GSM8K solution: its answer is what follows the last "####"."""
    truth = str(truth).rsplit("####", 1)[-1].strip()
    if predicted is None or not truth:  # a blank truth is a data error: an empty \boxed{} must not earn a reward
        return False
    a, b = normalize_number(predicted), normalize_number(truth)
    if a is not None and b is not None:
        return a == b
    if truth.lower() in _YES_NO:  # read in any case (extract_answer), so compared in any case; a boolean column's True
        return _YES_NO.get(_canonical(predicted).rstrip(".").lower()) == _YES_NO[truth.lower()]
    return _canonical(predicted) == _canonical(truth)


_YES_NO = {"yes": True, "true": True, "no": False, "false": False}


def _canonical(text: str) -> str:
    """`text` without a \\text{} (\\textbf, \\mathrm, \\mathbf) around all of it, blanks (but between digits), LaTeX spacing and
    \\left / \\right, with \\dfrac and \\tfrac as \\frac; a choice, (b) or B, as its capital letter; and as verl's
    strip_string: units in a trailing \\text{ ...}, a short left side ("y = "), \\sqrt3 as \\sqrt{3}, \\frac12 as \\frac{1}{2}."""
    whole = re.fullmatch(_WRAPPER, text.strip())
    s = re.sub(r"\\(?:left|right)(?![a-zA-Z])|\\[!,;: ]", "", whole.group(1) if whole else text)
    s = re.sub(r"\\text\{\s[^{}]*\}(?:\^\{?\d\}?)?\s*$", "", s)  # right units (verl): 2\sqrt{3}\text{ cm}
    s = re.sub(r"(?<!\d)\s+|\s+(?!\d)", "", s)  # but between digits: "3 4" is two numbers, not 34
    s = re.sub(r"\\[dt]frac(?![a-zA-Z])", r"\\frac", s)
    s = re.sub(r"^[a-zA-Z]\w?=(?!.*=)", "", s)  # "y = 2x+1": a short left side (verl's "k = ")
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)  # \sqrt3 -> \sqrt{3} (verl fix_sqrt)
    s = re.sub(r"\\frac(\w)(\w)", r"\\frac{\1}{\2}", s)  # \frac ab, \frac12 -> \frac{a}{b} (verl fix_fracs)
    choice = re.fullmatch(r"\(?([A-Ea-e])\)?", s)
    return choice.group(1).upper() if choice else s


@register("correct")
def correctness_reward(completion: str, answer: str) -> float:
    """1.0 when the extracted final answer equals the ground truth, else 0.0."""
    return float(answers_match(extract_answer(completion), answer))


@register("format")
def format_reward(completion: str, answer: str) -> float:
    """1.0 when the completion states its answer explicitly (\\boxed{} or "The answer is")."""
    return float(last_boxed(completion) is not None or bool(_ANSWER_IS.search(completion) or _GSM8K.search(completion)))


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, factor: float) -> float:
    """DAPO's soft overlong punishment (verl's overlong_buffer): 0 up to max_new_tokens - buffer completion tokens,
    then falling linearly to -factor at max_new_tokens; 0 with buffer 0."""
    return min(-(length - (max_new_tokens - buffer)) / buffer * factor, 0.0) if buffer else 0.0


def combined(names: tuple[str, ...], weights: tuple[float, ...]) -> Callable[[str, str, dict], float]:
    """reward(completion, answer, record) = sum_i weights[i] * reward names[i]; unknown names and functions of
    another signature fail here, at start-up. `record` is the prompt's record (its data_source / extra_info)."""
    if len(names) != len(weights):
        raise ValueError(f"reward.functions has {len(names)} names but reward.weights has {len(weights)} weights")
    fns = [_with_record(n, get(n)) for n in names]
    return lambda completion, answer, record: sum(w * f(completion, answer, record) for w, f in zip(weights, fns))


# verl's reward functions: compute_score(data_source, solution_str, ground_truth, extra_info=None, ...)
_VERL = ("data_source", "solution_str", "ground_truth")


def _with_record(name: str, f: Callable) -> Callable[[str, str, dict], float]:
    """f(completion, answer) as f(completion, answer, record); verl's compute_score called as verl's reward manager
    calls it: keyword arguments, the record's data_source and extra_info (verl's files' columns), and the 'score' of
    a dict it returns."""
    try:
        signature = inspect.signature(f)
    except ValueError:  # no signature to read (a builtin)
        return lambda completion, answer, record: f(completion, answer)
    params = signature.parameters
    if all(p in params for p in _VERL):
        extra = "extra_info" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())

        def verl(completion: str, answer: str, record: dict) -> float:
            kwargs = {"data_source": record.get("data_source"), "solution_str": completion, "ground_truth": answer}
            out = f(**kwargs, **({"extra_info": record.get("extra_info")} if extra else {}))
            return out["score"] if isinstance(out, dict) else out

        return verl
    try:
        signature.bind("", "")
    except TypeError as e:
        raise ValueError(f"reward {name!r} must be fn(completion, answer) -> float, or verl's compute_score("
                         f"data_source, solution_str, ground_truth, extra_info=None) ({e})") from None
    return lambda completion, answer, record: f(completion, answer)
