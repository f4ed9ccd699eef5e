"""Bucketed XOR digest of a replicated table: cheap to update, cheap to compare.

Each item (key, version) has a 64-bit hash; a bucket's hash is the XOR of the
hashes of its items and the root is the XOR of all of them. Adding, replacing
or removing an item is O(1) in hashing (plus a shift in a bucket's sorted key
list), two nodes with the same items have the same root, and a differing root
points at the few differing buckets, so an exchange ships only those buckets'
keys and versions, or, between large tables, first their leaf hashes (XORs over
the bucket's keys split by :func:`~p2psync.gossip.items.leaf_of`, computed when
asked: :mod:`p2psync.gossip.exchange`).

Keys are kept per bucket as sorted lists, not sets: a digest wants them sorted
anyway, and a list costs a third of the memory (a 10,000-member table holds
10,000 keys on every node, and the simulator holds 10,000 such tables).
"""

from __future__ import annotations

import bisect

from p2psync.gossip.items import BUCKETS, bucket_of


def hex32(h: int) -> str:
    """8 hex digits of a hash (its low 32 bits): what ``Buckets`` and ``Leaves`` carry per bucket or leaf."""
    return f"{h & 0xFFFFFFFF:08x}"


class BucketIndex:
    """XOR hashes per bucket plus the sorted keys in each bucket."""

    def __init__(self) -> None:
        self._hash = [0] * BUCKETS
        self._keys: list[list[str]] = [[] for _ in range(BUCKETS)]
        self.count = 0
        self._root: str | None = None
        self._hex = ["00000000"] * BUCKETS
        """Per bucket, 8 hex digits of its hash, kept up to date by :meth:`replace`: every Syn whose
        root differs is answered with them, and a change touches one bucket."""
        self._joined: str | None = None

    def copy(self) -> BucketIndex:
        c = BucketIndex()
        c._hash = list(self._hash)
        c._hex = list(self._hex)
        c._keys = [list(k) for k in self._keys]
        c.count = self.count
        return c

    def bucket(self, key: str) -> int:
        return bucket_of(key)

    def replace(self, key: str, old: int | None, new: int | None) -> None:
        """Account for ``key`` going from item hash ``old`` to ``new`` (None: absent)."""
        b = self.bucket(key)
        self._root = self._joined = None
        h = self._hash[b]
        if old is not None:
            h ^= old
        if new is not None:
            h ^= new
        self._hash[b] = h
        self._hex[b] = hex32(h)
        if old is None and new is not None:
            keys = self._keys[b]
            i = bisect.bisect_left(keys, key)
            if i == len(keys) or keys[i] != key:
                keys.insert(i, key)
                self.count += 1
        elif old is not None and new is None:
            keys = self._keys[b]
            i = bisect.bisect_left(keys, key)
            if i < len(keys) and keys[i] == key:
                del keys[i]
                self.count -= 1

    @property
    def root(self) -> str:
        if self._root is None:
            r = 0
            for h in self._hash:
                r ^= h
            self._root = f"{r:016x}"
        return self._root

    def bucket_hex(self) -> str:
        """8 hex digits per bucket (the low 32 bits of its XOR): what ``Buckets`` carries."""
        if self._joined is None:
            self._joined = "".join(self._hex)
        return self._joined

    def differing(self, other_hex: str) -> list[int]:
        """Buckets whose hash differs from ``other_hex`` (a ``bucket_hex`` of another node)."""
        return [b for b, h in enumerate(self._hex) if other_hex[8 * b:8 * b + 8] != h]

    def keys_in(self, bucket: int) -> list[str]:
        """The keys in ``bucket``, sorted (the caller must not change the list)."""
        return self._keys[bucket]
