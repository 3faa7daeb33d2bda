"""A problem as a caller gives it to a dispatcher of any model kind: the 'field=value,...'
string's parser, the errors of a query, and the memo key of a query as given.

Beneath every dispatcher (tilecast.runtime.dispatch, tilecast.table.dispatch, the shortlist):
it imports none of them.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

from tilecast.core.family import FamilyError

#: memoized rankings a dispatcher keeps (least recently used go first)
DEFAULT_CACHE_SIZE = 65536
#: the largest value any problem field may hold: every size is an int64 in the kernels
MAX_FIELD_VALUE = 2**63 - 1
PROBLEM_EXAMPLE = "m=512,n=512,k=512"
_FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_INTEGER = re.compile(r"[+-]?[0-9]+")
_DIGITS = re.compile(r"[+]?[0-9]+")


class ProblemError(FamilyError):
    """A problem as a user wrote it that cannot be read: a malformed 'field=value' string, a
    field given twice, a number not written as a whole number or too large for any field."""


class NoKernelError(ValueError):
    """No kernel of a model can run a problem: no candidate applies to it, nor the static best."""


def _too_large(value: str) -> bool:
    """Whether an integer literal is beyond MAX_FIELD_VALUE (by length first: int() refuses
    literals of more than 4300 digits)."""
    digits = value.lstrip("+-").lstrip("0")
    return len(digits) > len(str(MAX_FIELD_VALUE)) or int(digits or "0") > MAX_FIELD_VALUE


def parse_problem_string(text: str) -> dict[str, str]:
    """'m=128,n=256,k=64' -> {'m': '128', 'n': '256', 'k': '64'}: the fields of a problem as a
    user types it (`tilecast select --problem`, `tilecast rebench --problems`). Values stay
    strings: the family converts them (see parse_problem, which also does). ProblemError names
    a malformed pair (no '=', a key that is not a name, an empty value, a second '=' as in
    'm=1;n=2'), a field given twice, an integer beyond MAX_FIELD_VALUE, or a string with no
    field at all; empty pairs ('m=1,,n=2', a trailing comma) are ignored."""
    if not isinstance(text, str):
        raise TypeError(f"problem string must be a str, got {type(text).__name__}")
    values: dict[str, str] = {}
    for pair in text.split(","):
        pair = pair.strip()
        if not pair:
            continue
        key, sep, value = pair.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not _FIELD_NAME.fullmatch(key) or not value or "=" in value:
            raise ProblemError(f"malformed pair {pair!r} in problem {text!r}; expected "
                               f"field=value pairs separated by commas, e.g. {PROBLEM_EXAMPLE}")
        if key in values:
            raise ProblemError(f"field {key!r} given twice in problem {text!r} "
                               f"({key}={values[key]} and {key}={value}); give it once")
        if _INTEGER.fullmatch(value) and _too_large(value):
            raise ProblemError(f"field {key}={value} in problem {text!r} is too large: a "
                               f"problem field holds at most {MAX_FIELD_VALUE} (2**63 - 1)")
        values[key] = value
    if not values:
        raise ProblemError(f"empty problem string {text!r}; expected field=value pairs "
                           f"separated by commas, e.g. {PROBLEM_EXAMPLE}")
    return values


def parse_problem(text: str, family) -> Any:
    """The family's validated problem from a 'field=value,...' string. Stricter than a
    mapping: an integer field must be written in digits, so '1e3', '64.0' or '0x40' are
    refused (a config's 64.0 is a number, a typed '1e3' more likely a typo), and must come
    out of the family's conversion as the number written; a fraction (127.9), a negative or
    zero size is refused by the family. ProblemError / FamilyError name the field and value."""
    values = parse_problem_string(text)
    problem = family.problem(values)
    for key, value in values.items():
        converted = getattr(problem, key, None)
        if not isinstance(converted, int) or isinstance(converted, bool):
            continue
        if not _DIGITS.fullmatch(value):
            raise ProblemError(f"field {key}={value!r} in problem {text!r} is not a whole "
                               f"number written in digits; e.g. {key}={converted}")
        if converted != int(value):
            raise ProblemError(f"field {key}={value} in problem {text!r} is beyond what the "
                               f"{family.name} family holds exactly (it reads {converted})")
    return problem


def raw_key(problem) -> Any:
    """A hashable key of a query as given (None when it has none): the string itself, or a
    mapping's (key, value) pairs in key order."""
    if isinstance(problem, str):
        return problem
    if isinstance(problem, Mapping):
        try:
            key = ("items", *sorted(problem.items()))
            hash(key)
        except TypeError:
            return None
        return key
    return None
