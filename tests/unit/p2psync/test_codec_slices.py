"""Per-rank slices on the trainer side: row-block cuts where they pay, packing order, and the signed segment index."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from p2psync import keys
from p2psync.artifact import Manifest, build_manifest
from p2psync.codec.decode import Applier
from p2psync.codec import slices
from p2psync.codec.encode import CodecOptions, encode_delta, encode_delta_sparse
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


@pytest.fixture
def fine_cuts(monkeypatch):
    """Pieces of a few hundred changes pay here: these small tensors are cut as large ones are."""
    monkeypatch.setattr(slices, "MIN_PIECE_CHANGES", 256)


def test_cuts_may_fall_at_every_dim0_split_from_2_to_8_ranks():
    spec = TensorSpec("model.embed_tokens.weight", "BF16", (840, 32))  # 840 rows: every t in 2..8 divides it
    cuts = row_cuts(spec)
    for t in range(2, 9):
        for k in range(1, t):
            assert k * 840 // t * 32 in cuts
    assert row_cuts(TensorSpec("lm_head.weight", "BF16", (1024, 64))) == [k * 128 * 64 for k in range(1, 8)]
    ranges = delta_ranges(spec, 1 << 14)
    assert ranges[0][0] == 0 and ranges[-1][1] == spec.numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous
    # A job of at most 2**14 elements ends at the last row boundary inside it (row 504 of 840: 3/5),
    # not at 2**14, which would leave a sliver of rows before the next boundary.
    assert ranges[0] == (0, 504 * 32) and 504 * 32 in cuts and all(e - s <= 1 << 14 for s, e in ranges)
    # A row-parallel weight is cut alike: the rank of each row block decodes it for the group.
    assert row_cuts(TensorSpec("model.layers.0.mlp.down_proj.weight", "BF16", (256, 256))) == [
        r * 256 for r in sorted({k * 256 // t for t in range(2, 9) if 256 % t == 0 for k in range(1, t)})]
    assert row_cuts(TensorSpec("model.norm.weight", "BF16", (1 << 16,))) == []


def _one_tensor(rows: int, cols: int, changed: float, seed: int = 0) -> tuple[ModelState, ModelState]:
    g = torch.Generator().manual_seed(seed)
    old = ModelState([("model.layers.0.mlp.up_proj.weight", (torch.randn(rows, cols, generator=g) * 0.02
                                                             ).to(torch.bfloat16))])
    new = old.clone()
    w = new.words("model.layers.0.mlp.up_proj.weight")
    idx = np.random.default_rng(seed).choice(w.shape[0], size=int(w.shape[0] * changed), replace=False)
    w[idx] += 1
    new.invalidate()
    return old, new


def _spans(enc) -> list[tuple[int, int]]:
    """``(start, stop)`` of every segment of ``enc``, sorted."""
    from p2psync.codec.segindex import index_of

    return sorted((e[k + 1], e[k + 2]) for e in index_of(enc.chunks) for k in range(0, len(e), 3))


@pytest.mark.parametrize("changed, pieces", [(0.03, 1), (0.08, 2), (0.4, 8)])
def test_a_tensor_is_cut_only_where_each_piece_holds_enough_changes(changed, pieces):
    """1024 x 1024 words: 31k changes stay whole, 84k are cut in halves, 420k at every 8th row: a
    piece must hold 32,768 changes (slices.MIN_PIECE_CHANGES)."""
    old, new = _one_tensor(1024, 1024, changed)
    opts = CodecOptions(chunk_size=1 << 20)
    enc = encode_delta(old, new, opts)
    spans = _spans(enc)
    n = old.specs[0].numel
    cuts = sorted({a for a, _ in spans} - {0})
    assert len(cuts) == pieces - 1 and all(c in row_cuts(old.specs[0]) for c in cuts)
    assert all(c == k * n // pieces for k, c in enumerate(cuts, 1))  # the splits over 2, 4, 8 ranks, coarse first
    # The sparse path (changes found elsewhere) cuts alike, byte for byte.
    pos = np.flatnonzero(old.words(old.specs[0].name) != new.words(old.specs[0].name))
    sp = encode_delta_sparse(old, {old.specs[0].name: (pos, new.words(old.specs[0].name)[pos])}, opts)
    assert sp.chunks == enc.chunks
    ap = Applier.for_manifest(old, build_manifest(enc, model_id="t", base_version=0, target_version=1,
                                                  chunk_size=opts.chunk_size, private_key=None))
    ap.add_chunks(enumerate(enc.chunks), 1)
    assert ap.commit() == new.fingerprint


def test_a_cut_costs_under_one_percent_of_the_pieces_it_separates():
    """The rule's point: the same change encoded whole and cut where the rule cuts differs by < 1 %."""
    old, new = _one_tensor(1024, 1024, 0.08)
    opts = CodecOptions(chunk_size=1 << 20)
    cut = sum(map(len, encode_delta(old, new, opts).chunks))
    slices_min = slices.MIN_SLICED
    try:
        slices.MIN_SLICED = 1 << 62  # nothing is cut
        whole = sum(map(len, encode_delta(old, new, opts).chunks))
        slices.MIN_SLICED = slices_min
        slices.MIN_PIECE_CHANGES, keep = 0, slices.MIN_PIECE_CHANGES  # every split kept (8 pieces)
        every = sum(map(len, encode_delta(old, new, opts).chunks))
        slices.MIN_PIECE_CHANGES = keep
    finally:
        slices.MIN_SLICED = slices_min
    assert whole < cut < 1.01 * whole < every, (whole, cut, every)


def test_shards_cut_at_the_tensors_row_blocks():
    """A shard of a tensor (a sharded trainer's piece, offset rows) is cut at the tensor's row blocks,
    with the tensor's sample: its segments, shifted, are those of the whole tensor's encode."""
    from p2psync.codec.encode import encode_sparse_range
    from p2psync.codec.segment import shift_segment

    old, new = _one_tensor(1024, 1024, 0.4)
    spec = old.specs[0]
    n = spec.numel
    ow, nw = old.words(spec.name), new.words(spec.name)
    pos = np.flatnonzero(ow != nw)
    opts = CodecOptions(chunk_size=1 << 20)
    whole = encode_sparse_range(0, spec, ow, pos, nw[pos], 0, n, opts).segments
    off = n // 2  # rows 512.. of the tensor, as the second of two shards
    mine = pos[pos >= off] - off
    half = encode_sparse_range(0, spec, ow[off:], mine, nw[mine + off], 0, n - off, opts, offset=off).segments
    assert [bytes(shift_segment(s, off)) for s in half] == [bytes(s) for s in whole[len(whole) - len(half):]]
    assert len(half) == 4


def test_the_index_is_signed_and_lets_a_rank_find_its_rows_in_few_chunks(fine_cuts):
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
        keys_ = {order_key(m.tensors, e[k], e[k + 1], e[k + 2])[:3] for k in range(0, len(e), 3)}
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
def test_an_inconsistent_index_is_refused_with_a_typed_error(edit, field_msg, fine_cuts):
    _, _, m, _ = _signed()
    with pytest.raises(SegmentIndexError, match=field_msg) as err:
        Manifest.from_bytes(_rebody(m, edit))
    assert err.value.field == "segments" and isinstance(err.value, CodecError)


def test_a_forged_index_fails_the_signature_and_a_chunk_that_does_not_match_it_is_refused(fine_cuts):
    priv = keys.generate()
    _, _, m, chunks = _signed(priv)

    def swap(b):  # two chunks' entries exchanged: well-formed, but not what the trainer signed
        b["segments"][0], b["segments"][1] = b["segments"][1], b["segments"][0]
    forged = Manifest.from_bytes(_rebody(m, swap))
    with pytest.raises(SignatureError):
        forged.verify(priv.public_key())
    with pytest.raises(SegmentIndexError, match="chunk 0"):
        check_chunk(forged.segments, 0, chunks[0])


def test_a_manifest_without_an_index_still_parses(fine_cuts):
    _, _, m, _ = _signed()
    old = _rebody(m, lambda b: b.pop("segments"))
    back = Manifest.from_bytes(old)
    assert back.segments == () and "segments" not in back.body()
