"""A results document held against its declared records (``results.schema``): every value of a
key the schema declares has the declared type, and every number is finite.

The readers (fit, report, compare, the stages that resume) index what the schema declares; a
file edited by hand, cut short by a full disk in another tool, or written by something else
reaches them only after this check, so a wrong type is a one-line error naming where it is,
never a traceback from deep inside a reader. Keys the schema does not declare are left alone
(a newer writer's additions), and every key may be missing (records are ``total=False``). A null
may stand for any value: ``finite_json`` writes a figure it could not compute as one, and the
writers record what was not known (a chip's thermal state, a prompt set's size) as one.
"""

from __future__ import annotations

import contextlib
import functools
import math
import traceback
import types
import typing
from pathlib import Path
from typing import Any, Iterator

from mac_moesd.errors import MacMoesdError
from mac_moesd.results import schema

__all__ = ["first_problem", "read_guard", "undeclared_keys"]

# What a reader raises on a record that passed ``first_problem`` but lacks a key it needs, or
# holds a null, an empty list or a zero where it needs a figure.
# AssertionError: a reader's asserts state what a file this version wrote always holds
_READ_ERRORS = (KeyError, TypeError, ValueError, IndexError, AttributeError, ZeroDivisionError, AssertionError)

_NUMBERS = (int, float)


@functools.lru_cache(maxsize=None)
def _hints(record: type) -> dict[str, Any]:
    return typing.get_type_hints(record)


def _alternatives(hint) -> tuple:
    if typing.get_origin(hint) is typing.Union or isinstance(hint, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")


def _problem(value, hint, where: str) -> str | None:
    """What is wrong with ``value`` as ``hint`` says it should be, at ``where``; None if nothing."""
    if value is None:
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return f"{where} is {value!r}, not a finite number"
    options = _alternatives(hint)
    if hint is Any or any(o is Any for o in options):
        return None
    reasons = []
    for option in options:
        reason = _fits(value, option, where)
        if reason is None:
            return None
        if option is not type(None):  # "not null" says nothing a null-free option does not
            reasons.append(reason)
    return min(reasons, key=len) if reasons else f"{where} is {_kind(value)}, not null"


def _fits(value, hint, where: str) -> str | None:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return f"{where} is {_kind(value)}, not null"
    if typing.is_typeddict(hint):
        if not isinstance(value, dict):
            return f"{where} is {_kind(value)}, not an object"
        hints = _hints(hint)
        for key, item in value.items():
            if key in hints:
                found = _problem(item, hints[key], f"{where}.{key}")
                if found:
                    return found
        return None
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            return f"{where} is {_kind(value)}, not an object"
        inner = args[1] if args else Any
        return next((p for key, item in value.items() if (p := _problem(item, inner, f"{where}[{key!r}]"))), None)
    if origin in (list, tuple) or hint in (list, tuple):
        if not isinstance(value, list):
            return f"{where} is {_kind(value)}, not a list"
        inner = args[0] if args else Any
        return next((p for i, item in enumerate(value) if (p := _problem(item, inner, f"{where}[{i}]"))), None)
    if hint is bool:
        return None if isinstance(value, bool) else f"{where} is {_kind(value)}, not a boolean"
    if hint is float:
        ok = isinstance(value, _NUMBERS) and not isinstance(value, bool)
        return None if ok else f"{where} is {_kind(value)}, not a number"
    if hint is int:  # a count a writer may have summed from weights: any number, not a string
        ok = isinstance(value, _NUMBERS) and not isinstance(value, bool)
        return None if ok else f"{where} is {_kind(value)}, not a number"
    if hint is str:
        return None if isinstance(value, str) else f"{where} is {_kind(value)}, not a string"
    return None  # a hint this check does not know (none today) is not held against the file


def first_problem(data: dict) -> str | None:
    """The first place where ``data`` (a results document in today's schema) differs from
    ``schema.ResultsFile``, said in a few words; None when it holds what the schema declares."""
    return _problem(data, schema.ResultsFile, "")


def undeclared_keys(data: dict, record: type = schema.ResultsFile) -> list[str]:
    """Paths of the keys of ``data`` (a results file, or another ``record`` of ``results.schema``)
    that no record declares. Readers leave such keys alone; a writer must not make them (the
    tests hold every file they write to this), so the schema stays the one statement of what a
    file holds."""
    return _undeclared(data, record, "")


def _undeclared(value, hint, where: str) -> list[str]:
    options = [o for o in _alternatives(hint) if o is not type(None)]
    if len(options) > 1:
        return min((_undeclared(value, o, where) for o in options), key=len)
    hint = options[0] if options else hint
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if isinstance(value, dict) and typing.is_typeddict(hint):
        hints = _hints(hint)
        out = []
        for key, item in value.items():
            if key == "null_reasons":  # any object may say why a figure is null (finite_json)
                continue
            out += [f"{where}.{key}"] if key not in hints else _undeclared(item, hints[key], f"{where}.{key}")
        return out
    if isinstance(value, dict) and origin is dict:
        return [p for key, item in value.items() for p in _undeclared(item, args[1], f"{where}[{key!r}]")]
    if isinstance(value, list) and origin is list:
        return [p for i, item in enumerate(value) for p in _undeclared(item, args[0], f"{where}[{i}]")]
    return []


@contextlib.contextmanager
def read_guard(path: Path) -> Iterator[None]:
    """Around a command's reading of the results file at ``path`` (report, fit, compare): a
    record its reader cannot use ends in one line naming the file and the reader's place (so a
    file this version wrote, and a reader's own bug, can be told apart), never a traceback."""
    try:
        yield
    except _READ_ERRORS as err:
        frame = traceback.extract_tb(err.__traceback__)[-1]
        place = f"{Path(frame.filename).parent.name}/{Path(frame.filename).name}:{frame.lineno}"
        raise MacMoesdError(f"{path} holds a record its reader cannot use ({type(err).__name__} {err} at "
                            f"{place}): was it edited by hand? It was left untouched") from err
