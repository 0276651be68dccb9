"""How the config reports a problem: a ``ConfigError`` with one ``key.path: problem and fix``
line per problem, whether pass 1 of [Note: how a config is checked] (load.py) found it or
pydantic did (``config_error`` rewrites pydantic's errors in the same form)."""

import difflib
import json
from typing import Any

from pydantic import ValidationError
from pydantic_core import PydanticCustomError

from zerotrain.errors import ZeroTrainError

__all__ = ["ConfigError", "config_error", "did_you_mean", "fail", "show"]


class ConfigError(ZeroTrainError, ValueError):
    """A config zerotrain cannot use. The message names every offending key path and the fix,
    one problem per line."""


def fail(message: str) -> PydanticCustomError:
    """A validation error whose message ``config_error`` prints as is after the key path."""
    # The message travels in the context so that braces in user values are not format fields.
    return PydanticCustomError("zerotrain", "{message}", {"message": message})


def show(value: Any, limit: int | None = None) -> str:
    """``value`` as the user wrote it (JSON), cut to ``limit`` characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if limit is None or len(text) <= limit else text[: limit - 3] + "..."


def did_you_mean(word: str, candidates: list[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``candidates``, or ``""``."""
    match = difflib.get_close_matches(word, candidates, n=1)
    return f"; did you mean '{match[0]}'?" if match else ""


_ERROR_MESSAGES = {  # pydantic error type -> our wording; ", got <input>" is appended
    "missing": "required key is missing",
    "extra_forbidden": "unknown key",
    **dict.fromkeys(("int_type", "int_parsing", "int_from_float"), "must be an integer"),
    **dict.fromkeys(("float_type", "float_parsing"), "must be a number"),
    **dict.fromkeys(("bool_type", "bool_parsing"), "must be true or false"),
    **dict.fromkeys(("dict_type", "model_type", "model_attributes_type"), "must be a mapping"),
    "list_type": "must be a list",
    "tuple_type": "must be a list",
    "finite_number": "must be a finite number",
    "literal_error": "must be one of {expected}",
    "greater_than": "must be > {gt}",
    "greater_than_equal": "must be >= {ge}",
    "less_than": "must be < {lt}",
    "less_than_equal": "must be <= {le}",
}


def config_error(error: ValidationError) -> ConfigError:
    """Pass 2 of [Note: how a config is checked]: one ``path: problem`` line per error; a
    value that matches none of a union's types gets one line naming each's problem, or where
    one of them took it, the problem inside it."""
    problems: dict[tuple[str, str], list[str]] = {}  # (path, got) -> the problems, in order
    in_unions: list[str] = []  # the paths of the problems a union's member found
    for item in error.errors():
        path = ".".join(str(part) for part in item["loc"] if not _union_member(part))
        if any(_union_member(part) for part in item["loc"]):
            in_unions.append(path)
        got = ""
        if item["type"] == "zerotrain":
            text = item["msg"]
        else:
            ctx = item.get("ctx", {})
            template = _ERROR_MESSAGES.get(item["type"])
            text = template.format(**ctx) if template else item["msg"][0].lower() + item["msg"][1:]
            if item["type"] not in ("missing", "extra_forbidden"):
                got = f", got {show(item['input'])}"
        problems.setdefault((path, got), []).append(text)
    lines = []
    for (path, got), texts in problems.items():
        if path in in_unions and any(other.startswith(path + ".") for other in in_unions):
            continue  # a union member took the value and found a problem inside it: that one
        text = ", or ".join(dict.fromkeys(texts)) + got
        lines.append(f"{path}: {text}" if path else text)
    return ConfigError("\n".join(lines))


def _union_member(part: object) -> bool:
    """Whether a location's ``part`` is pydantic's name for the member of a union it tried
    (``literal['auto','none']``, ``list[...]``, ``float``), not a key or an index."""
    return isinstance(part, str) and ("[" in part or part in ("int", "float", "str", "bool"))
