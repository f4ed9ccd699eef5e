"""JSON-like data to typed values, with one library (msgspec) and field-named errors.

Every place that turns outside data into a typed object goes through here: the node config
(:mod:`p2psync.typed_toml`), the coordinator's HTTP bodies (:mod:`p2psync.control.bodies`), the
gossip wire messages (:mod:`p2psync.gossip.messages`) and the vLLM backend's requests
(:mod:`rollout.engines.vllm.worker.infos`). Each declares its schema as types (a dataclass or a
``msgspec.Struct``, constraints as ``Annotated[int, Meta(ge=0)]``), and :func:`convert` (a decoded
value) or :func:`decode_json` (bytes) checks it in ``strict`` mode, as JSON means it: an integer
field takes only a JSON integer (not ``"5"``, ``5.0`` or ``true``), a number field an integer or a
float, a boolean only ``true``/``false``.

A refusal is the caller's own error type, built by ``error(field, message)``, where ``field`` is
the dotted path of the bad value (``init_info.version``, ``reports.1.tokens``, ``limits.port``;
a list index is a path part, a key of a free-form object is ``*``) and ``message`` says what was
expected, derived from the schema, and what came (``must be an integer >= 0, got str '5'``).
The value is not shown for a field named in ``secrets``.

msgspec reports the path only inside its message text (``... - at `$.a.b[0]```), which
:func:`field_error` reads; ``tests/unit/p2psync/test_validate.py`` pins that format, so a msgspec
that changed it fails there first.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Collection
from typing import Any, TypeVar, overload

import msgspec
from msgspec import inspect as mi

T = TypeVar("T")
ErrorFactory = Callable[[str, str], Exception]
Key = str | int | None
"""One step of a path: an object key, a list index, or None for a key msgspec does not name."""

FINITE = sys.float_info.max
"""``Meta(ge=-FINITE, le=FINITE)``: a finite number (infinity is refused by the bound, NaN by any bound)."""
NON_BLANK = r"\S"
"""``Meta(pattern=NON_BLANK)``: a string with something in it besides spaces."""

_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")
_MISSING = re.compile(r"^Object missing required field `(?P<name>.*)`$", re.S)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>.*)`$", re.S)
_ABSENT = object()
_DECODERS: dict[Any, msgspec.json.Decoder[Any]] = {}
"""One decoder per schema type, built at its first use (building one compiles the schema)."""
_MISSING_MARK = "\0missing"
_UNKNOWN_MARK = "\0unknown"


@overload
def convert(data: Any, tp: type[T], *, error: ErrorFactory, where: str = ..., secrets: Collection[str] = ...,
            forbid_unknown: bool = ..., objects: str = ...) -> T: ...
@overload
def convert(data: Any, tp: Any, *, error: ErrorFactory, where: str = ..., secrets: Collection[str] = ...,
            forbid_unknown: bool = ..., objects: str = ...) -> Any: ...
def convert(data: Any, tp: Any, *, error: ErrorFactory, where: str = "", secrets: Collection[str] = (),
            forbid_unknown: bool = False, objects: str = "a JSON object") -> Any:
    """``data`` (dicts, lists and scalars) as a ``tp``, or ``error(field, message)`` raised.

    ``where`` prefixes every field (``init_info``); ``forbid_unknown`` refuses keys a dataclass
    does not declare, in nested dataclasses too (a ``Struct`` says so itself, with
    ``forbid_unknown_fields``); ``objects`` names an object in messages (``a table`` for TOML).
    """
    if forbid_unknown:
        extra = _unknown_key(mi.type_info(tp), data, [])
        if extra is not None:
            raise _refusal(_UNKNOWN_MARK, extra, data, tp, where, error, secrets, objects)
    try:
        return msgspec.convert(data, tp, strict=True)
    except msgspec.ValidationError as exc:
        raise field_error(exc, data, tp, error=error, where=where, secrets=secrets, objects=objects) from None


@overload
def decode_json(raw: bytes | str, tp: type[T], *, error: ErrorFactory, not_json: Callable[[str], Exception],
                where: str = ..., secrets: Collection[str] = ...) -> T: ...
@overload
def decode_json(raw: bytes | str, tp: Any, *, error: ErrorFactory, not_json: Callable[[str], Exception],
                where: str = ..., secrets: Collection[str] = ...) -> Any: ...
def decode_json(raw: bytes | str, tp: Any, *, error: ErrorFactory, not_json: Callable[[str], Exception],
                where: str = "", secrets: Collection[str] = ()) -> Any:
    """The JSON text ``raw`` decoded and checked as a ``tp`` in one pass (no intermediate dicts);
    ``not_json(reason)`` is raised for text that is not JSON, ``error(field, message)`` as in
    :func:`convert` for JSON that does not fit."""
    try:
        decoder = _DECODERS.get(tp)
        if decoder is None:
            decoder = _DECODERS[tp] = msgspec.json.Decoder(tp)
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:
        data = msgspec.json.decode(raw)  # only on a refusal: the values the message shows
        raise field_error(exc, data, tp, error=error, where=where, secrets=secrets) from None
    except msgspec.DecodeError as exc:
        raise not_json(str(exc)) from None


def field_error(exc: msgspec.ValidationError, data: Any, tp: Any, *, error: ErrorFactory, where: str = "",
                secrets: Collection[str] = (), objects: str = "a JSON object") -> Exception:
    """The caller's error for msgspec's refusal ``exc`` of ``data`` as a ``tp``."""
    m = _AT.match(str(exc))
    what, path = (m["what"], m["path"] or "") if m else (str(exc), "")
    keys: list[Key] = [name if name else (None if index == "..." else int(index))
                       for name, index in _STEP.findall(path)]
    for mark, pattern in ((_MISSING_MARK, _MISSING), (_UNKNOWN_MARK, _UNKNOWN)):
        hit = pattern.match(what)
        if hit:
            return _refusal(mark, [*keys, hit["name"]], data, tp, where, error, secrets, objects)
    return _refusal(what, keys, data, tp, where, error, secrets, objects)


def _refusal(what: str, keys: list[Key], data: Any, tp: Any, where: str, error: ErrorFactory,
             secrets: Collection[str], objects: str) -> Exception:
    field = ".".join([where] * bool(where) + ["*" if k is None else str(k) for k in keys])
    if what == _MISSING_MARK:
        return error(field, "missing (required)")
    if what == _UNKNOWN_MARK:
        parent = _info_at(mi.type_info(tp), keys[:-1], data)
        known = [f.encode_name for f in parent.fields] if isinstance(parent, (mi.StructType, mi.DataclassType)) else []
        return error(field, f"unknown key (known: {', '.join(known)})" if known else "unknown key")
    info = _info_at(mi.type_info(tp), keys, data)
    expected = _describe(info, objects) if info is not None else None
    value = _value_at(data, keys)
    shown = "" if value is _ABSENT else f", got {_shown(value, keys[-1] in secrets if keys else False)}"
    if expected is None:  # a type this module does not describe: msgspec's own words
        return error(field, what[0].lower() + what[1:] + shown)
    return error(field, f"must be {expected}{shown}")


def _value_at(data: Any, keys: list[Key]) -> Any:
    for k in keys:
        if isinstance(data, dict) and isinstance(k, str) and k in data:
            data = data[k]
        elif isinstance(data, (list, tuple)) and isinstance(k, int) and 0 <= k < len(data):
            data = data[k]
        else:
            return _ABSENT
    return data


def _unwrap(info: mi.Type, data: Any) -> mi.Type:
    """The member of a union that ``data`` is checked against (by its tag, or the one non-null)."""
    if not isinstance(info, mi.UnionType):
        return info
    types = [t for t in info.types if not isinstance(t, mi.NoneType)]
    tagged = [t for t in types if isinstance(t, mi.StructType) and t.tag_field is not None]
    if tagged and isinstance(data, dict):
        for t in tagged:
            if data.get(t.tag_field) == t.tag:
                return t
    return types[0] if len(types) == 1 else info


def _info_at(info: mi.Type | None, keys: list[Key], data: Any) -> mi.Type | None:
    """The schema of the value at ``keys`` (None where the path leaves the schema)."""
    for k in keys:
        if info is None:
            return None
        info = _unwrap(info, data)
        data = _value_at(data, [k])
        if isinstance(info, mi.UnionType):
            tags = [t.tag for t in info.types if isinstance(t, mi.StructType) and t.tag_field == k]
            return mi.LiteralType(tuple(tags)) if tags else None
        if isinstance(info, (mi.StructType, mi.DataclassType)):
            info = next((f.type for f in info.fields if f.encode_name == k), None)
        elif isinstance(info, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
            info = info.item_type
        elif isinstance(info, mi.TupleType) and isinstance(k, int) and k < len(info.item_types):
            info = info.item_types[k]
        elif isinstance(info, mi.DictType):
            info = info.value_type
        else:
            return None
    return _unwrap(info, data) if info is not None else None


def _bounds(info: mi.IntType | mi.FloatType, number: Callable[[Any], str]) -> str:
    # +-sys.float_info.max as a bound only refuses infinity (and NaN fails every bound): "finite".
    ge, le = (None if v is not None and abs(v) == sys.float_info.max else v for v in (info.ge, info.le))
    if ge is not None and le is not None:
        return f" in {number(ge)}..{number(le)}"
    parts = [f"{op} {number(v)}" for op, v in ((">=", ge), (">", info.gt), ("<=", le), ("<", info.lt)) if v is not None]
    return " " + " and ".join(parts) if parts else ""


def _describe(info: mi.Type, objects: str) -> str | None:
    """What a value of ``info`` is, in words (``an integer >= 0``); None for a type not covered."""
    if isinstance(info, mi.IntType):
        return "an integer" + _bounds(info, str)
    if isinstance(info, mi.FloatType):
        finite = sys.float_info.max in (info.le, -(info.ge or 0.0))
        return ("a finite number" if finite else "a number") + _bounds(info, lambda v: f"{v:g}")
    if isinstance(info, mi.BoolType):
        return "true or false"
    if isinstance(info, mi.StrType):
        if info.pattern == NON_BLANK:
            text = "a non-blank string"
        elif info.pattern is not None:
            text = f"a string matching {info.pattern}"
        else:
            text = "a non-empty string" if info.min_length else "a string"
        if info.max_length is not None:
            text += f" of at most {info.max_length} chars"
        return text
    if isinstance(info, mi.LiteralType):
        return "one of " + ", ".join(str(v) for v in info.values)
    if isinstance(info, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
        item = _describe(_unwrap(info.item_type, None), objects)
        size = f" of at most {info.max_length} items" if info.max_length is not None else ""
        return f"a list{size}" + (f", each {item}" if item else "")
    if isinstance(info, mi.TupleType):
        items = [_describe(_unwrap(t, None), objects) or "any value" for t in info.item_types]
        return f"a list of {len(items)} items: " + ", ".join(items)
    if isinstance(info, (mi.DictType, mi.StructType, mi.DataclassType, mi.TypedDictType)):
        return objects
    if isinstance(info, mi.NoneType):
        return "null"
    if isinstance(info, mi.UnionType):
        parts = [_describe(t, objects) for t in info.types if not isinstance(t, mi.NoneType)]
        return None if None in parts else " or ".join(dict.fromkeys(p for p in parts if p))
    return None


def _shown(value: Any, secret: bool) -> str:
    kind = "null" if value is None else type(value).__name__
    if secret:
        return f"{kind} (not shown: a secret)"
    if value is None:
        return kind
    text = repr(value)
    return f"{kind} {text if len(text) <= 40 else text[:37] + '...'}"


def _unknown_key(info: mi.Type, data: Any, keys: list[Key]) -> list[Key] | None:
    """The path of the first key of ``data`` that its dataclass (or a nested one) does not declare."""
    info = _unwrap(info, data)
    if isinstance(info, mi.DataclassType) and isinstance(data, dict):
        fields = {f.encode_name: f.type for f in info.fields}
        for k, v in data.items():
            if k not in fields:
                return [*keys, str(k)]
            deeper = _unknown_key(fields[k], v, [*keys, k])
            if deeper is not None:
                return deeper
    return None
