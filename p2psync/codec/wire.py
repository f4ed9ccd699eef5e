"""Bounds-checked little-endian reading, so that any malformed input ends in a typed error."""

from __future__ import annotations

import struct

from p2psync.errors import CodecError, TruncatedError


class Reader:
    __slots__ = ("buf", "pos", "what")

    def __init__(self, buf: bytes | memoryview, what: str) -> None:
        self.buf = memoryview(buf)
        self.pos = 0
        self.what = what

    def take(self, n: int) -> memoryview:
        if n < 0:
            raise CodecError(f"{self.what}: negative length")
        end = self.pos + n
        if end > len(self.buf):
            raise TruncatedError(f"{self.what}: truncated (needs {end} bytes, has {len(self.buf)})")
        out = self.buf[self.pos : end]
        self.pos = end
        return out

    def unpack(self, fmt: str) -> tuple:
        st = struct.Struct("<" + fmt)
        return st.unpack(self.take(st.size))

    def u8(self) -> int:
        return self.unpack("B")[0]

    def u16(self) -> int:
        return self.unpack("H")[0]

    def u32(self) -> int:
        return self.unpack("I")[0]

    def u64(self) -> int:
        return self.unpack("Q")[0]

    def done(self) -> None:
        if self.pos != len(self.buf):
            raise CodecError(f"{self.what}: {len(self.buf) - self.pos} trailing bytes")
