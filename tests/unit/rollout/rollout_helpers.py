"""Shared pieces of the rollout tests: real trained versions, their real deltas, an in-memory WorkSource."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from p2psync import keys
from p2psync.artifact import Manifest, build_manifest
from p2psync.codec.encode import CodecOptions, encode_delta, encode_snapshot
from p2psync.control.api import Grant, ResponseResult
from p2psync.errors import LeaseExpired
from p2psync.state import ModelState

if TYPE_CHECKING:
    from rollout.engines.vllm.apply.weights import LiveWeights

CHUNK = 64 << 10


@dataclass
class Versions:
    """Published versions 0..n of a real tiny model trained with AdamW, and the signed artifacts between them."""

    states: list[ModelState]
    snapshot: tuple[Manifest, list[bytes]]
    deltas: list[tuple[Manifest, list[bytes]]]
    """``deltas[i]`` goes from version i to i + 1."""
    private_key: Any


def trained_versions(steps: int = 3, preset: str = "tiny", lr: float = 1e-3, warmup: int = 1, seed: int = 0
                     ) -> Versions:
    """Version 0 is the model after ``warmup`` steps; versions 1.. one AdamW step each.

    The (tied) embedding is scaled up at init so that the next-token distributions are
    peaked, not near-uniform: log-prob and sampling checks then have something to miss.
    """
    from p2psync.presets import build_model
    from trainer.workload import Workload

    model = build_model(preset, seed=seed)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(3.0)
    w = Workload(model, lr=lr, seed=seed)
    for _ in range(warmup):
        w.step()
    priv = keys.generate()
    opts = CodecOptions(chunk_size=CHUNK)
    states = [ModelState(w.published())]
    enc = encode_snapshot(states[0], opts)
    snap = (build_manifest(enc, model_id=preset, target_version=0, chunk_size=CHUNK, private_key=priv), enc.chunks)
    deltas = []
    for v in range(1, steps + 1):
        w.step()
        new = ModelState(w.published())
        enc = encode_delta(states[-1], new, opts)
        m = build_manifest(enc, model_id=preset, base_version=v - 1, target_version=v, chunk_size=CHUNK,
                           private_key=priv)
        deltas.append((m, enc.chunks))
        states.append(new)
    return Versions(states, snap, deltas, priv)


def live_snapshot(model: torch.nn.Module) -> ModelState:
    """The model's parameters as a state, each tied tensor once (what a trainer would publish)."""
    seen, items = set(), []
    for n, p in model.named_parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            items.append((n, p.detach().clone()))
    return ModelState(items)


def bits_equal(state: ModelState, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names whose raw words differ between ``state`` and ``tensors`` (empty: bit-exact)."""
    bad = []
    for name in state:
        a = state.words(name)
        b = tensors[name].contiguous().reshape(-1).view(torch.int16).numpy()
        if a.shape != b.shape or not (a.view(b.dtype) == b).all():
            bad.append(name)
    return bad


@dataclass
class MemoryWork:
    """An in-memory :class:`p2psync.control.api.WorkSource` (stand-in until ``node.work`` exists)."""

    queue: list[Grant] = field(default_factory=list)
    progress_log: list[tuple[str, int, int, list[int], list[float], list[int]]] = field(default_factory=list)
    completed: dict[str, dict[int, ResponseResult]] = field(default_factory=dict)
    released: list[str] = field(default_factory=list)
    released_all: int = 0
    expire: set[str] = field(default_factory=set)
    """Work ids whose lease is lost: progress/complete raise LeaseExpired."""
    held: dict[str, Grant] = field(default_factory=dict)
    requests: int = 0
    request_versions: list = field(default_factory=list)
    """The ``version`` each request said it generates with."""
    on_progress: Any = None
    """Optional async callback(work_id, response, offset, n_tokens), awaited inside progress()."""
    available: asyncio.Event | None = None

    def add(self, grant: Grant) -> None:
        self.queue.append(grant)
        if self.available is not None:
            self.available.set()

    async def request(self, max_items: int = 1, wait: float = 5.0, version: int | None = None) -> list[Grant]:
        self.requests += 1
        self.request_versions.append(version)
        if not self.queue:
            if self.available is None:
                self.available = asyncio.Event()
            self.available.clear()
            try:
                async with asyncio.timeout(wait):
                    await self.available.wait()
            except TimeoutError:
                return []
        out, self.queue = self.queue[:max_items], self.queue[max_items:]
        for g in out:
            self.held[g.work_id] = g
        return out

    async def progress(self, grant: Grant, response: int, offset: int, tokens: Sequence[int],
                       logprobs: Sequence[float], versions: Sequence[int]) -> None:
        if grant.work_id in self.expire:
            raise LeaseExpired(grant.work_id)
        self.progress_log.append((grant.work_id, response, offset, list(tokens), list(logprobs), list(versions)))
        if self.on_progress is not None:
            await self.on_progress(grant.work_id, response, offset, len(tokens))

    async def complete(self, grant: Grant, responses: dict[int, ResponseResult]) -> bool:
        if grant.work_id in self.expire:
            raise LeaseExpired(grant.work_id)
        self.held.pop(grant.work_id, None)
        if grant.work_id in self.completed:
            return False
        self.completed[grant.work_id] = dict(responses)
        return True

    async def release(self, grant: Grant) -> None:
        self.held.pop(grant.work_id, None)
        self.released.append(grant.work_id)

    async def release_all(self) -> None:
        self.released_all += 1
        self.released.extend(self.held)
        self.held.clear()


def grant(work_id: str, payload: dict, responses: int = 1, resume: dict | None = None, done: dict | None = None,
          lease_id: int = 1) -> Grant:
    return Grant(work_id, lease_id, payload, responses, resume or {}, done or {})


def apply_with_failing_writes(live: LiveWeights, manifest: Manifest, chunks: Sequence[bytes | None],
                              fail: bool) -> str:
    """How ``live.apply_delta(manifest, chunks)`` ends ("applied", or the error's class name) when, with
    ``fail``, this rank's host writes are made and then raise ``OSError("injected write failure")``: a
    rank that fails after it wrote, which every rank must take back (the ranks that do not fail pass
    ``fail=False`` and run the same code)."""
    from rollout.engines.vllm.apply.ranks import RankRefused

    real = live._write_host

    def failing(*args, **kw):
        real(*args, **kw)
        raise OSError("injected write failure")
    if fail:
        live._write_host = failing  # type: ignore[method-assign]
    try:
        live.apply_delta(manifest, chunks)
        return "applied"
    except (RankRefused, OSError) as exc:
        return type(exc).__name__
    finally:
        if fail:
            del live._write_host
