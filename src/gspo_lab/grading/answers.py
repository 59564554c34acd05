"""Reading answers out of model output, and math checks: the one home of what tasks' checkers and reward
functions both use (below both: this module imports neither).

math-verify (sympy underneath) can take forever on model output: `\\boxed{7^{7^{7^{7}}}}` is a number with more
digits than atoms in the universe. Its own timeout (`signal.alarm`) covers only parts of its work, so anything
here that meets model output through math-verify must run where it can be killed: gspo_lab.grading.pool's
workers (reward functions with `reward.num_workers`, evaluation with `eval.grading_workers`).

>>> last_boxed(r"first \\boxed{1}, then \\boxed{\\frac{1}{2}}")
'\\\\frac{1}{2}'
>>> last_number("The sum is 1,000.")
1000.0
>>> math_answer(r"so $\\boxed{\\frac{1}{2}}$") == math_answer(r"$\\boxed{0.5}$") == "0.5"
True
>>> math_equal("7", "so the answer is 7", latex_only=False), math_equal("7", r"\\boxed{8}"), math_equal("x", "7")
(1.0, 0.0, None)
"""

from __future__ import annotations

import functools
import re
from typing import Any

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def text_of(completion: Any) -> str:
    """A completion's text: the string itself, or a conversational completion's last message's content."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


def last_boxed(text: str) -> str | None:
    r"""The content of the last `\boxed{...}` in `text`, braces balanced, or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def last_number(text: str) -> float | None:
    """The last number in `text` (thousands separators dropped), or None."""
    found = NUMBER.findall(text)
    try:
        return float(found[-1].replace(",", "")) if found else None
    except ValueError:
        return None


@functools.cache
def _extraction(latex_only: bool) -> list:
    """math-verify's extraction of a completion's answer: LaTeX, boxed first, anchored answers only; with
    `latex_only=False` plain expressions too. Built once per setting."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    latex = LatexExtractionConfig(
        normalization_config=NormalizationConfig(nits=False, malformed_operators=False, basic_latex=True,
                                                 boxed="all", units=True),
        boxed_match_priority=0, try_extract_without_anchor=False)
    return [latex] if latex_only else [latex, ExprExtractionConfig()]


def math_answer(text: str, latex_only: bool = True) -> str | None:
    """The answer math-verify extracts from `text` (a rational or decimal number as its value to 12 digits, so
    0.5 and 1/2 agree; anything else as its sympy string), or None: what maj@k votes on for math tasks.
    An irrational or huge value stays a string: turning `7^{7^{7^{7}}}` into a float never returns."""
    from math_verify import parse

    try:
        got = parse(text, extraction_config=_extraction(latex_only), extraction_mode="first_match")
    except Exception:  # noqa: BLE001 - extraction must not raise on model output
        return None
    if not got:
        return None
    value = got[0]
    if getattr(value, "is_Rational", False) or getattr(value, "is_Float", False):
        try:
            return format(float(value), ".12g")
        except (OverflowError, TypeError, ValueError):  # beyond a float's range
            pass
    try:
        return str(value)
    except ValueError:  # an integer with more digits than Python turns into text
        return None


def math_equal(reference: str, text: str, latex_only: bool = True) -> float | None:
    r"""1.0 where math-verify finds the answer of `text` equal to `reference` (`\frac{1}{2}` = 0.5, units, boxed),
    0.0 where not, None where the reference does not parse. The reference is parsed as TRL's and open-r1's
    accuracy reward parse the gold (default extraction, first match); `text` with `_extraction(latex_only)`."""
    from math_verify import parse, verify

    gold = parse(str(reference), extraction_mode="first_match")
    if not gold:
        return None
    got = parse(text, extraction_config=_extraction(latex_only), extraction_mode="first_match")
    return float(verify(gold, got))
