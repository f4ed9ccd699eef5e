"""Per-rank slices on the trainer side: row-block cuts, packing order, and the signed segment index."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from p2psync import keys
from p2psync.artifact import Manifest, build_manifest
from p2psync.codec.decode import Applier
from p2psync.codec.encode import CodecOptions, encode_delta
from p2psync.codec.segindex import check_chunk
from p2psync.codec.slices import delta_ranges, order_key, row_cuts
from p2psync.errors import CodecError, SegmentIndexError, SignatureError
from p2psync.state import ModelState, TensorSpec

OPTS = CodecOptions(chunk_size=64 << 10, segment_elements=1 << 14)


def _states() -> tuple[ModelState, ModelState]:
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (240, 256), "model.layers.0.self_attn.q_proj.weight": (256, 256),
              "model.layers.0.self_attn.o_proj.weight": (256, 256), "model.norm.weight": (256,)}
    old = ModelState([(n, (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16)) for n, s in shapes.items()])
    new = old.clone()
    rng = np.random.default_rng(1)
    for n in new:
        w = new.words(n)
        idx = rng.choice(w.shape[0], size=w.shape[0] // 2, replace=False)
        w[idx] ^= rng.integers(1, 1 << 15, size=idx.shape[0]).astype(w.dtype)  # a few chunks' worth
    new.invalidate()
    return old, new


def _signed(priv=None) -> tuple[ModelState, ModelState, Manifest, list[bytes]]:
    old, new = _states()
    enc = encode_delta(old, new, OPTS)
    m = build_manifest(enc, model_id="t", base_version=0, target_version=1, chunk_size=OPTS.chunk_size,
                       private_key=priv)
    return old, new, m, enc.chunks


def test_cuts_keep_every_dim0_split_from_2_to_8_ranks():
    spec = TensorSpec("model.embed_tokens.weight", "BF16", (840, 32))  # 840 rows: every t in 2..8 divides it
    cuts = row_cuts(spec)
    for t in range(2, 9):
        for k in range(1, t):
            assert k * 840 // t * 32 in cuts
    assert row_cuts(TensorSpec("lm_head.weight", "BF16", (1024, 64))) == [k * 128 * 64 for k in range(1, 8)]
    ranges = delta_ranges(spec, 1 << 14)
    assert ranges[0][0] == 0 and ranges[-1][1] == spec.numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, and no range crosses a cut
    assert not any(s < c < e for s, e in ranges for c in cuts)
    # A row-parallel weight is cut alike: the rank of each row block decodes it for the group.
    assert row_cuts(TensorSpec("model.layers.0.mlp.down_proj.weight", "BF16", (256, 256))) == [
        r * 256 for r in sorted({k * 256 // t for t in range(2, 9) if 256 % t == 0 for k in range(1, t)})]
    assert row_cuts(TensorSpec("model.norm.weight", "BF16", (1 << 16,))) == []


def test_the_index_is_signed_and_lets_a_rank_find_its_rows_in_few_chunks():
    priv = keys.generate()
    old, new, m, chunks = _signed(priv)
    back = Manifest.from_bytes(m.to_bytes())
    back.verify(priv.public_key())
    assert back.segments == m.segments and len(m.segments) == len(chunks) > 2
    for i, c in enumerate(chunks):
        check_chunk(back.segments, i, c)
    # The first half of the embedding's rows lie in fewer chunks than the whole delta has.
    emb = [i for i, e in enumerate(m.segments)
           if any(e[k] == 0 and e[k + 1] < 120 * 256 for k in range(0, len(e), 3))]
    assert 0 < len(emb) < len(chunks)
    # A chunk holds one block fraction of the cut tensors, or only uncut tensors: no chunk holds two
    # ranks' rows at any split over 2..8 ranks.
    for e in m.segments:
        keys_ = {order_key(m.tensors, e[k], e[k + 1])[:2] for k in range(0, len(e), 3)}
        assert len(keys_) == 1, e
    # Cutting and ordering change where segments sit, not what they decode to.
    ap = Applier.for_manifest(old, back)
    ap.add_chunks(enumerate(chunks), 1)
    assert ap.commit() == new.fingerprint


def _rebody(m: Manifest, edit) -> bytes:
    raw = m.to_bytes()
    (n,) = struct.unpack_from("<I", raw, 6)
    body = json.loads(raw[10:10 + n])
    edit(body)
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    return raw[:4] + struct.pack("<HI", m.format_version, len(text)) + text + raw[10 + n:]


@pytest.mark.parametrize("edit, field_msg", [
    (lambda b: b["segments"].pop(), "one entry per chunk"),
    (lambda b: b["segments"][0].append(0), "tensor, start, stop"),
    (lambda b: b["segments"][0].__setitem__(0, 99), "outside the tensor table"),
    (lambda b: b["segments"][0].__setitem__(2, 10 ** 9), "outside the tensor table"),
    (lambda b: b["segments"][-1].extend(b["segments"][0][:3]), "overlap"),
    (lambda b: b.__setitem__("segments", "x"), "one entry per chunk"),
])
def test_an_inconsistent_index_is_refused_with_a_typed_error(edit, field_msg):
    _, _, m, _ = _signed()
    with pytest.raises(SegmentIndexError, match=field_msg) as err:
        Manifest.from_bytes(_rebody(m, edit))
    assert err.value.field == "segments" and isinstance(err.value, CodecError)


def test_a_forged_index_fails_the_signature_and_a_chunk_that_does_not_match_it_is_refused():
    priv = keys.generate()
    _, _, m, chunks = _signed(priv)

    def swap(b):  # two chunks' entries exchanged: well-formed, but not what the trainer signed
        b["segments"][0], b["segments"][1] = b["segments"][1], b["segments"][0]
    forged = Manifest.from_bytes(_rebody(m, swap))
    with pytest.raises(SignatureError):
        forged.verify(priv.public_key())
    with pytest.raises(SegmentIndexError, match="chunk 0"):
        check_chunk(forged.segments, 0, chunks[0])


def test_a_manifest_without_an_index_still_parses():
    _, _, m, _ = _signed()
    old = _rebody(m, lambda b: b.pop("segments"))
    back = Manifest.from_bytes(old)
    assert back.segments == () and "segments" not in back.body()
