"""Extraction with torch gives the same chunks as the CPU scan, on CPU and (where present) CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from p2psync.codec.encode import CodecOptions, encode_delta, encode_delta_sparse
from p2psync.codec.extract import extract
from p2psync.errors import TensorTableMismatch
from p2psync.state import ModelState

OPTS = CodecOptions(chunk_size=64 << 10, segment_elements=4096)
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.int32, torch.int64,
          torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]


def pair(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    old, new = {}, {}
    for i, dt in enumerate(DTYPES):
        bits = torch.randint(-128, 128, (3000,), generator=g, dtype=torch.int8)
        width = torch.empty(0, dtype=dt).element_size()
        raw = torch.randint(-(2**15), 2**15, (3000 * width // 2 + 1,), generator=g, dtype=torch.int16)
        base = raw.view(torch.int8)[: 3000 * width].view(dt) if dt != torch.bool else (bits > 0)
        changed = base.clone()
        idx = torch.randperm(3000, generator=g)[:300]
        if dt == torch.bool:
            changed[idx] = ~changed[idx]
        else:
            flat = changed.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width])
            flat[idx] = flat[idx] ^ 1  # one-bit changes, including NaN payloads and -0.0
        old[f"t{i}"], new[f"t{i}"] = base, changed
    return old, new


def check(device: str) -> None:
    old, new = pair()
    base, target = ModelState(old), ModelState(new)
    cpu_chunks = encode_delta(base, target, OPTS).chunks
    dev_old = {k: v.to(device) for k, v in old.items()}
    dev_new = {k: v.to(device) for k, v in new.items()}
    sparse = extract(dev_old, dev_new)
    assert encode_delta_sparse(base, sparse, OPTS).chunks == cpu_chunks
    for k in old:
        assert np.array_equal(sparse[k][0], np.flatnonzero(base.words(k) != target.words(k)))


def test_torch_extraction_matches_cpu_scan():
    check("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_extraction_gives_the_same_bytes():
    check("cuda")


def test_extraction_refuses_a_different_table():
    old, new = pair()
    new["t0"] = new["t0"].reshape(30, 100)
    with pytest.raises(TensorTableMismatch) as ei:
        extract(old, new)
    assert ei.value.reshaped == ["t0"]
    new.pop("t0")
    with pytest.raises(TensorTableMismatch) as ei:
        extract(old, new)
    assert ei.value.unknown == ["t0"] or ei.value.missing == ["t0"]
