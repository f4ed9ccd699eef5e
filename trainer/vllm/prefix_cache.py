"""Resetting vLLM's prefix cache after an update, through whatever client the trainer gave the engine.

vLLM's ``finish_weight_update`` leaves the prefix cache as it was: a prompt whose prefix was cached
before an update is served from KV computed with the previous weights (docs/INTEGRATIONS.md). The
``VLLMWeightSyncClient`` protocol has no call for it, so the engine resets it through what the
client offers (:func:`resetter`), in this order:

- the client's own ``reset_prefix_cache()`` (a framework's client, or a test's);
- an ``HTTPVLLMWeightSyncClient`` (any client with a ``base_url``): ``POST {base_url}/reset_prefix_cache``,
  the server's development route (``VLLM_SERVER_DEV_MODE=1``, which the weight-transfer routes need too);
- a ``RayVLLMWeightSyncClient`` (``handles``): ``reset_prefix_cache()`` on every actor.

vLLM answers ``false`` while KV blocks are still held (requests running); the reset is tried again
for up to ``patience_s`` before it is reported as refused.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

RETRY_S = (0.05, 0.1, 0.2, 0.5, 1.0)


class NotReset(Exception):
    """The servers kept their prefix cache (``detail`` says what they answered)."""


def _http(client: Any) -> Callable[[], bool]:
    base = str(client.base_url).rstrip("/")
    timeout = getattr(client, "timeout", 300)

    def reset() -> bool:
        import requests

        response = requests.post(f"{base}/reset_prefix_cache", timeout=timeout)
        response.raise_for_status()
        try:
            body = response.json()
        except ValueError:
            return True  # a server that answers without a body has reset it
        return bool(body.get("success", True)) if isinstance(body, dict) else True

    return reset


def _ray(handles: list[Any]) -> Callable[[], bool]:
    def reset() -> bool:
        import ray  # type: ignore[import-not-found]

        return all(r is not False for r in ray.get([h.reset_prefix_cache.remote() for h in handles]))

    return reset


def _own(method: Callable[[], Any]) -> Callable[[], bool]:
    def reset() -> bool:
        return method() is not False

    return reset


def resetter(client: Any) -> Callable[[], bool] | None:
    """How to reset the prefix cache of ``client``'s servers (see module doc); ``None``: it offers no way."""
    method = getattr(client, "reset_prefix_cache", None)
    if callable(method):
        return _own(method)
    if isinstance(getattr(client, "base_url", None), str):
        return _http(client)
    handles = getattr(client, "handles", None)
    if isinstance(handles, list) and handles and all(hasattr(h, "reset_prefix_cache") for h in handles):
        return _ray(handles)
    return None


def reset_prefix_cache(reset: Callable[[], bool], patience_s: float = 10.0) -> None:
    """Run ``reset`` until the servers report the cache reset; :class:`NotReset` after ``patience_s``."""
    deadline = time.monotonic() + patience_s
    tries = 0
    while True:
        if reset():
            return
        if time.monotonic() >= deadline:
            raise NotReset(f"the servers still held KV blocks after {tries + 1} tries in {patience_s:g} s "
                           "(requests running during the update?)")
        time.sleep(RETRY_S[min(tries, len(RETRY_S) - 1)])
        tries += 1
