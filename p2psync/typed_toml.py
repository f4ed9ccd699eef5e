"""Typed dataclasses from TOML tables and ``--section.field=value`` overrides.

:func:`build` fills a (nested) dataclass from a dict, converting each value to its
field's annotated type (``str``, ``int``, ``float``, ``bool``, ``list[str]``, optional
ones, nested dataclasses as tables) and raising :class:`~p2psync.errors.ConfigError`
that names the field's dotted path for an unknown key or a value of the wrong
type. :func:`parse_overrides` turns command-line overrides into the same nested
dicts, :func:`merge` lays one over another, and :func:`read_toml` reads a file
with the same typed errors. :mod:`p2psync.config` builds the node's settings
with them.
"""

from __future__ import annotations

import types
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import tomllib

from p2psync.errors import ConfigError


def read_toml(path: str | Path) -> dict[str, Any]:
    """The TOML file at ``path`` as a dict (a typed error if it cannot be read or parsed)."""
    try:
        return tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError("config", f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", f"{path} is not valid TOML: {exc}") from None


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _coerce(name: str, tp: Any, value: Any) -> Any:
    tp, optional = _unwrap_optional(tp)
    if value is None and optional:
        return None
    if typing.get_origin(tp) is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(name, f"must be a list of strings, got {value!r}")
        return list(value)
    if tp is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        if not isinstance(value, bool):
            raise ConfigError(name, f"must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, str):
            try:
                return int(value, 0)
            except ValueError:
                raise ConfigError(name, f"must be an integer, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(name, f"must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise ConfigError(name, f"must be a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(name, f"must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(name, f"must be a string, got {value!r}")
        return value
    raise ConfigError(name, f"unsupported field type {tp!r}")  # pragma: no cover - programming error


def build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """An instance of dataclass ``cls`` from ``data`` (see module doc); ``prefix`` names its table."""
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in known:
            raise ConfigError(path, "unknown setting")
        tp = hints[key]
        if isinstance(tp, type) and is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(path, "must be a table")
            kwargs[key] = build(tp, value, f"{path}.")
        else:
            kwargs[key] = _coerce(path, tp, value)
    return cls(**kwargs)


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``["--limits.stall_timeout=3", "--parents", "http://a,http://b"]`` -> nested dict of raw values.

    A value that parses as a TOML value (number, bool, array, quoted string) is taken as such,
    anything else as a plain string; the field's type decides the final conversion.
    """
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) < 3:
            raise ConfigError(arg, "expected --section.field=value")
        key, eq, raw = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(key, "missing value")
            raw = args[i + 1]
            i += 1
        i += 1
        key = key.replace("-", "_")
        try:
            value: Any = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(key, "conflicts with another override")
        node[parts[-1]] = value
    return out


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` laid over ``base``, table by table."""
    merged = dict(base)
    for k, v in over.items():
        merged[k] = merge(merged[k], v) if isinstance(v, dict) and isinstance(merged.get(k), dict) else v
    return merged
