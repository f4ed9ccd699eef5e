"""Typed dataclasses from TOML tables and ``--section.field=value`` overrides.

:func:`build` fills a (nested) dataclass from a dict with :func:`p2psync.validate.convert`
(msgspec, strict: each value of its field's annotated type, ``str``, ``int``, ``float``,
``bool``, ``list[str]``, optional ones, nested dataclasses as tables), after text where
a field is not text was converted by the command line's rules (:func:`_from_text`); it
raises :class:`~p2psync.errors.ConfigError` naming the field's dotted path for an unknown
key or a value of the wrong type (``limits.parallel_streams: must be an integer, got str
'abc'``), never showing the cluster token. :func:`parse_overrides` turns command-line overrides into the same nested
dicts, :func:`merge` lays one over another, and :func:`read_toml` reads a file
with the same typed errors. :mod:`p2psync.config` builds the node's settings
with them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import tomllib
from msgspec import inspect as mi

from p2psync.errors import ConfigError
from p2psync.validate import convert

T = TypeVar("T")


def read_toml(path: str | Path) -> dict[str, Any]:
    """The TOML file at ``path`` as a dict (a typed error if it cannot be read or parsed)."""
    try:
        return tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError("config", f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", f"{path} is not valid TOML: {exc}") from None


_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
SECRETS = ("cluster_token",)
"""Settings whose values a refusal never shows."""


def _from_text(info: mi.Type, value: Any) -> Any:
    """``value`` with text converted where its field is not text: what a command-line override
    (``--limits.stall_timeout 2.5``, ``--parents=https://a,https://b``) or a quoted TOML value gives.

    An integer takes ``int(text, 0)`` (``0x10``, ``1_000``), a number ``float(text)``, a boolean
    true/false/yes/no/1/0 in any case, a list of strings comma-separated text; text that does not
    convert stays text, for :func:`~p2psync.validate.convert` to refuse naming the field.
    """
    if isinstance(info, mi.UnionType):  # X | None
        kinds = [t for t in info.types if not isinstance(t, mi.NoneType)]
        info = kinds[0] if len(kinds) == 1 else info
    if isinstance(info, mi.DataclassType) and isinstance(value, dict):
        fields = {f.encode_name: f.type for f in info.fields}
        return {k: _from_text(fields[k], v) if k in fields else v for k, v in value.items()}
    if not isinstance(value, str):
        return value
    if isinstance(info, mi.ListType) and isinstance(info.item_type, mi.StrType):
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(info, mi.BoolType):
        return _WORDS.get(value.lower(), value)
    try:
        if isinstance(info, mi.IntType):
            return int(value, 0)
        if isinstance(info, mi.FloatType):
            return float(value)
    except ValueError:
        pass
    return value


def build(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """An instance of dataclass ``cls`` from ``data`` (see module doc); ``prefix`` names its table."""
    return convert(_from_text(mi.type_info(cls), data), cls, error=ConfigError, where=prefix.rstrip("."),
                   secrets=SECRETS, forbid_unknown=True, objects="a table")


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
