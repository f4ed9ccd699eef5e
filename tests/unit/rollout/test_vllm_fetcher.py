"""The vLLM backend's kept client (:class:`rollout.engines.vllm.worker.fetch.Fetcher`), with calls that fail
on purpose: a call without side effects that finds a kept client unreachable is tried once on a new
one; any other failure, or one on a new client, is raised and the next call gets a new client."""

from __future__ import annotations

import pytest

from p2psync.errors import PeerUnreachable, SignatureError
from rollout.engines.vllm.worker.fetch import Fetcher


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
        assert f.run("t" * 20, "engine", 5.0, "", call, retry=True) == 1
        assert f.run("t" * 20, "engine", 5.0, "", call, retry=True) == 3  # failed on the kept one, then a new one
        assert seen[0] is seen[1] and seen[2] is not seen[1]
        call, seen = _calls([None, PeerUnreachable])
        f.run("t" * 20, "engine", 5.0, "", call)
        with pytest.raises(PeerUnreachable):  # not retried: the call may have had effects
            f.run("t" * 20, "engine", 5.0, "", call)
        assert f.run("t" * 20, "engine", 5.0, "", call) == 3 and seen[2] is not seen[1]
    finally:
        f.close()


def test_a_failure_on_a_new_client_or_of_another_kind_is_raised_and_the_client_replaced():
    f = Fetcher()
    try:
        call, seen = _calls([PeerUnreachable])
        with pytest.raises(PeerUnreachable):  # a new client: nothing stale to blame
            f.run("t" * 20, "engine", 5.0, "", call, retry=True)
        call, seen = _calls([None, SignatureError])
        f.run("t" * 20, "engine", 5.0, "", call, retry=True)
        with pytest.raises(SignatureError):
            f.run("t" * 20, "engine", 5.0, "", call, retry=True)
        f.run("t" * 20, "engine", 5.0, "", call)
        assert seen[0] is seen[1] and seen[2] is not seen[1]
        # Another parent identity: another client.
        f.run("t" * 20, "other", 5.0, "", call)
        assert seen[3] is not seen[2]
    finally:
        f.close()
