"""Run in a fresh process by test_codec_precompile: the kernels each path loads, with or without a warm-up.

    python precompile_paths.py {node,vllm} {warm,cold}

Prints a JSON list: the codec kernels the path loaded or compiled itself (``first_use``).
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

from p2psync import keys
from p2psync.artifact import build_manifest
from p2psync.codec import precompile
from p2psync.codec.decode import Applier
from p2psync.codec.encode import CodecOptions, encode_delta
from p2psync.state import ModelState


def states(n: int = 50_000, seed: int = 3) -> tuple[ModelState, ModelState]:
    g = torch.Generator().manual_seed(seed)
    old = ModelState([("a", torch.randn(n // 500, 500, generator=g).to(torch.bfloat16)),
                      ("b", torch.randn(n // 2, generator=g).to(torch.bfloat16))])
    new = old.clone()
    rng = np.random.default_rng(seed)
    for name in new:
        w = new.words(name)
        idx = rng.choice(w.shape[0], w.shape[0] // 20, replace=False)
        w[idx] += rng.integers(1, 3, idx.shape[0]).astype(w.dtype)
    new.invalidate()
    return old, new


def main(path: str, warm: bool) -> list[str]:
    old, new = states()
    opts = CodecOptions(chunk_size=256 << 10, segment_elements=1 << 14)
    enc = encode_delta(old, new, opts)  # the trainer's work, not watched here
    m = build_manifest(enc, model_id="t", base_version=0, target_version=1, chunk_size=opts.chunk_size,
                       private_key=keys.generate())
    changes = {}
    for i, name in enumerate(old):
        pos = np.flatnonzero(old.words(name) != new.words(name))
        changes[i] = (pos, new.words(name)[pos])
    if path == "node":
        if warm:
            precompile.warm(("BF16",))
        with precompile.first_use() as loaded:
            relay = old.clone()
            ap = Applier.onto(relay, m)
            ap.add_chunks(enumerate(enc.chunks), 2)  # a relay or rollout node: decode the chunks
            assert ap.commit() == new.fingerprint
            trainer = old.clone()  # the trainer node: adopt the publisher's changes
            assert Applier.adopting(trainer, m, changes).commit() == new.fingerprint
        return loaded
    from rollout.engines.vllm.worker import warm as vllm_warm
    from rollout.engines.vllm.apply.weights import LiveWeights

    module = torch.nn.Module()
    for name in old:
        module.register_parameter(name, torch.nn.Parameter(old.tensor(name).clone(), requires_grad=False))
    live = LiveWeights(module, old.specs, threads=2)
    if warm:
        vllm_warm.start(module).join()
    with precompile.first_use() as loaded:
        assert live.apply_delta(m, enc.chunks) == new.fingerprint
    return loaded


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2] == "warm")))
