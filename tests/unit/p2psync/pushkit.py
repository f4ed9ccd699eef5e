"""Shared by the push tests: a small model's versions, their signed artifacts, node configs."""

from __future__ import annotations

import asyncio

import numpy as np

from p2psync import config, keys
from p2psync.artifact import build_manifest
from p2psync.codec.encode import CodecOptions, encode_delta, encode_snapshot
from p2psync.node import Node
from p2psync.state import ModelState

TOKEN = "push-test-token-0123"
CHUNK = 64 << 10


def states(n: int = 3) -> list[ModelState]:
    import torch

    g = torch.Generator().manual_seed(11)
    w = {"a": torch.randn(300_000, generator=g).bfloat16(), "b": torch.randn(50, 9, generator=g).bfloat16()}
    out = [ModelState({k: v.clone() for k, v in w.items()})]
    for _ in range(n):
        for t in w.values():
            flat = t.view(-1)
            idx = torch.randint(0, flat.numel(), (flat.numel() // 20,), generator=g)
            flat[idx] = (flat[idx].float() * 1.01).bfloat16()
        out.append(ModelState({k: v.clone() for k, v in w.items()}))
    return out


def artifacts(priv, states):
    opts = CodecOptions(chunk_size=CHUNK, segment_elements=16384)
    enc = encode_snapshot(states[0], opts)
    arts = [(build_manifest(enc, model_id="m", target_version=0, chunk_size=CHUNK, private_key=priv), enc.chunks)]
    for v in range(1, len(states)):
        enc = encode_delta(states[v - 1], states[v], opts)
        arts.append((build_manifest(enc, model_id="m", target_version=v, base_version=v - 1, chunk_size=CHUNK,
                                    private_key=priv), enc.chunks))
    return arts


def cfg(tmp_path, name, role, parents=(), **extra):
    common = {"cluster_token": TOKEN, "trainer_public_key": str(tmp_path / "keys" / "trainer.pub"),
              "limits": {"poll_interval": 30.0, "sse_keepalive": 1.0, "retry_after": 0.2, "stall_timeout": 3.0,
                         **extra.pop("limits", {})},
              "store": {"snapshot_interval": 0}}
    return config.load(overrides={**common, "id": name, "role": role, "data_dir": str(tmp_path / name),
                                  "parents": list(parents), **extra})


def same(a: ModelState, b: ModelState) -> bool:
    return all(np.array_equal(a.words(n), b.words(n)) for n in b)


async def padded(*parents: tuple[Node, int]) -> None:
    """Wait until each (parent, n children) padded its children's streams: a child opens its
    stream unpadded while it starts and re-opens it padded once settled; a delta announced
    during that re-open is pulled instead of pushed."""
    async with asyncio.timeout(60):
        for node, n in parents:
            while node.metrics.total("p2psync_stream_padding_bytes_total") < n * node.config.limits.stream_warmup_bytes:
                await asyncio.sleep(0.05)


def make_setup(tmp_path):
    """(trainer key, versions 0-3, their artifacts), the trainer's public key written under ``tmp_path/keys``."""
    priv = keys.generate()
    keys.write_pair(priv, tmp_path / "keys")
    vs = states()
    return priv, vs, artifacts(priv, vs)
