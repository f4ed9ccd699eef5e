"""p2psync.validate: msgspec's refusals become the caller's error, naming the field by its dotted path."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

import msgspec
import pytest
from msgspec import Meta

from p2psync.errors import ConfigError
from p2psync.validate import NON_BLANK, convert, decode_json

Nat = Annotated[int, Meta(ge=0)]


@dataclass
class Inner:
    port: Annotated[int, Meta(ge=0, le=65535)] = 0
    names: list[str] = field(default_factory=list)
    token: str = ""
    ratio: float = 1.0


@dataclass
class Outer:
    inner: Inner = field(default_factory=Inner)
    role: Literal["a", "b"] = "a"
    maybe: int | None = None


class Item(msgspec.Struct, forbid_unknown_fields=True):
    name: Annotated[str, Meta(pattern=NON_BLANK)]
    sizes: Annotated[list[Nat], Meta(max_length=2)] = []


class Box(msgspec.Struct):
    items: list[Item]
    free: dict[str, Nat] = {}


def _refusal(data, tp, **kw):
    with pytest.raises(ConfigError) as err:
        convert(data, tp, error=ConfigError, **kw)
    return err.value


@pytest.mark.parametrize("data, tp, kw, text", [
    ({"inner": {"port": "5"}}, Outer, {}, "inner.port: must be an integer in 0..65535, got str '5'"),
    ({"inner": {"port": 5.0}}, Outer, {}, "inner.port: must be an integer in 0..65535, got float 5.0"),
    ({"inner": {"port": True}}, Outer, {}, "inner.port: must be an integer in 0..65535, got bool True"),
    ({"inner": {"port": -1}}, Outer, {}, "inner.port: must be an integer in 0..65535, got int -1"),
    ({"inner": {"names": ["x", 1]}}, Outer, {}, "inner.names.1: must be a string, got int 1"),
    ({"inner": 3}, Outer, {"objects": "a table"}, "inner: must be a table, got int 3"),
    ({"role": "c"}, Outer, {}, "role: must be one of a, b, got str 'c'"),
    ({"maybe": "1"}, Outer, {}, "maybe: must be an integer, got str '1'"),
    ({"inner": {"prot": 1}}, Outer, {"forbid_unknown": True}, "inner.prot: unknown key (known: port, names, token, ratio)"),
    ({"items": [{"name": "a"}, {}]}, Box, {"where": "box"}, "box.items.1.name: missing (required)"),
    ({"items": [{"name": " "}]}, Box, {}, "items.0.name: must be a non-blank string, got str ' '"),
    ({"items": [{"name": "a", "x": 1}]}, Box, {}, "items.0.x: unknown key (known: name, sizes)"),
    ({"items": [{"name": "a", "sizes": [1, 2, 3]}]}, Box, {},
     "items.0.sizes: must be a list of at most 2 items, each an integer >= 0, got list [1, 2, 3]"),
    ({"items": [], "free": {"k": -1}}, Box, {}, "free.*: must be an integer >= 0"),
    ([1], Box, {"where": "body"}, "body: must be a JSON object, got list [1]"),
])
def test_a_refusal_names_the_path_and_what_was_expected(data, tp, kw, text):
    assert str(_refusal(data, tp, **kw)) == text


def test_strict_json_types_and_secrets():
    assert convert({"inner": {"ratio": 2}}, Outer, error=ConfigError).inner.ratio == 2.0  # an integer is a number
    err = _refusal({"inner": {"token": 12345678}}, Outer, secrets=("token",))
    assert err.field == "inner.token" and "12345678" not in str(err)
    assert convert({"inner": {"prot": 1}}, Outer, error=ConfigError).inner == Inner()  # unknown keys: only if asked


def test_decode_json_checks_in_one_pass_and_tells_bad_json_apart():
    assert decode_json(b'{"items": [{"name": "a", "sizes": [1]}]}', Box, error=ConfigError,
                       not_json=ValueError).items[0].sizes == [1]
    with pytest.raises(ConfigError) as err:
        decode_json(b'{"items": [{"name": "a", "sizes": [-1]}]}', Box, error=ConfigError, not_json=ValueError)
    assert str(err.value) == "items.0.sizes.0: must be an integer >= 0, got int -1"
    with pytest.raises(ValueError, match="malformed|truncated"):
        decode_json(b'{"items": [', Box, error=ConfigError, not_json=ValueError)


def test_msgspec_still_reports_paths_the_way_this_module_reads_them():
    # If a msgspec upgrade changes this text, every field name above degrades: fix the adapter first.
    with pytest.raises(msgspec.ValidationError, match=r"^Expected `int` >= 0 - at `\$\.items\[0\]\.sizes\[1\]`$"):
        msgspec.convert({"items": [{"name": "a", "sizes": [0, -1]}]}, Box)
    with pytest.raises(msgspec.ValidationError, match=r"^Object missing required field `name` - at `\$\.items\[0\]`$"):
        msgspec.convert({"items": [{}]}, Box)
    with pytest.raises(msgspec.ValidationError, match=r"^Object contains unknown field `x` - at `\$\.items\[0\]`$"):
        msgspec.convert({"items": [{"name": "a", "x": 1}]}, Box)
