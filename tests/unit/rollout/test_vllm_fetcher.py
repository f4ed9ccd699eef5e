"""The vLLM backend's kept client (:class:`p2psync.transport.leaf.Fetcher`), with calls that fail on
purpose: a call without side effects that finds a kept client unreachable is tried once on a new one;
any other failure, or one on a new client, is raised and the next call gets a new client; another
parent gets another client."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives import serialization

from p2psync import keys
from p2psync.errors import PeerUnreachable, SignatureError
from p2psync.transport.leaf import Fetcher, Parent

PEM = keys.generate().public_key().public_bytes(serialization.Encoding.PEM,
                                                 serialization.PublicFormat.SubjectPublicKeyInfo).decode()
PARENT = Parent.create("http://127.0.0.1:9", "t" * 20, PEM, "engine", timeout=5.0)


def _calls(fail: list[type[Exception] | None]):
    seen: list[object] = []

    async def call(client):
        seen.append(client)
        exc = fail.pop(0) if fail else None
        if exc is not None:
            raise exc("http://parent", "dead connection") if exc is PeerUnreachable else exc("refused")
        return len(seen)

    return call, seen


def test_an_unreachable_kept_client_is_replaced_and_the_call_tried_again():
    f = Fetcher()
    try:
        call, seen = _calls([None, PeerUnreachable])
        assert f.run(PARENT, call, retry=True) == 1
        assert f.run(PARENT, call, retry=True) == 3  # failed on the kept one, then a new one
        assert seen[0] is seen[1] and seen[2] is not seen[1]
        call, seen = _calls([None, PeerUnreachable])
        f.run(PARENT, call)
        with pytest.raises(PeerUnreachable):  # not retried: the call may have had effects
            f.run(PARENT, call)
        assert f.run(PARENT, call) == 3 and seen[2] is not seen[1]
    finally:
        f.close()


def test_a_failure_on_a_new_client_or_of_another_kind_is_raised_and_the_client_replaced():
    f = Fetcher()
    try:
        call, seen = _calls([PeerUnreachable])
        with pytest.raises(PeerUnreachable):  # a new client: nothing stale to blame
            f.run(PARENT, call, retry=True)
        call, seen = _calls([None, SignatureError])
        f.run(PARENT, call, retry=True)
        with pytest.raises(SignatureError):
            f.run(PARENT, call, retry=True)
        f.run(PARENT, call)
        assert seen[0] is seen[1] and seen[2] is not seen[1]
        # Another parent (here: another identity): another client.
        f.run(Parent.create("http://127.0.0.1:9", "t" * 20, PEM, "other", timeout=5.0), call)
        assert seen[3] is not seen[2]
    finally:
        f.close()
