"""Publisher: a trainer Node and a following Node on loopback hold the trainer's bits at every version."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from p2psync import config, keys
from p2psync.errors import P2PSyncError
from p2psync.node import Node
from p2psync.state import ModelState
from trainer.publish_record import PublishError
from trainer.publisher import Publisher
from p2psync.presets import build_model
from trainer.workload import Workload

pytestmark = pytest.mark.timeout(120)
TOKEN = "publisher-test-token"


def _configs(tmp_path):
    priv = keys.generate()
    keys.write_pair(priv, tmp_path / "keys")
    common = {"cluster_token": TOKEN, "trainer_public_key": str(tmp_path / "keys" / "trainer.pub"),
              "limits": {"poll_interval": 0.5, "sse_keepalive": 1.0, "retry_after": 0.2},
              "store": {"snapshot_interval": 0}}
    tr = config.load(overrides={**common, "id": "trainer", "role": "trainer", "data_dir": str(tmp_path / "t"),
                                "trainer_private_key": str(tmp_path / "keys" / "trainer.key")})
    return priv, tr, common


async def _follower(tmp_path, common, parent: str, name: str = "rollout") -> Node:
    cfg = config.load(overrides={**common, "id": name, "role": "rollout", "data_dir": str(tmp_path / name),
                                 "parents": [parent]})
    return await Node.create(cfg)


def _words(t: torch.Tensor) -> np.ndarray:
    from p2psync import dtypes

    return dtypes.words_of(t.contiguous()).copy()


def _same_bits(state: ModelState, expected: dict[str, torch.Tensor]) -> None:
    assert list(state) == list(expected)
    for name, t in expected.items():
        assert np.array_equal(state.words(name), _words(t)), name


def _workload(lr: float = 1e-3) -> Workload:
    return Workload(build_model("tiny", seed=3), lr=lr, batch=2, seq=16, seed=3)


@pytest.mark.parametrize("guarded,verify_own", [(False, False), (True, False), (False, True)],
                         ids=["inline", "optimizer-guard", "trainer-decodes-its-own"])
def test_follower_holds_the_trainers_bits_at_every_version(tmp_path, guarded, verify_own):
    """Lock-step versions compared bit for bit (on the follower and the trainer node, which takes the
    publisher's changes, or decodes its own chunks with ``verify_own``), then pipelined versions
    compared by fingerprint and at the end."""
    priv, tr_cfg, common = _configs(tmp_path)
    w = _workload()
    # A weight outside the optimizer, set by hand to bit patterns float arithmetic would not keep.
    extra = torch.nn.Parameter(torch.zeros(8), requires_grad=False)
    w.model.register_parameter("extra", extra)
    specials = [float("nan"), -0.0, float("inf"), float("-inf"), 1e-40, -1e-40, 3.0, -0.0]

    def poke(v: int) -> None:
        with torch.no_grad():
            extra.copy_(torch.tensor(specials[v % 8:] + specials[: v % 8]))
    poke(0)

    async def go():
        tr = await Node.create(tr_cfg)
        fol = await _follower(tmp_path, common, tr.address)
        try:
            pub = await Publisher.create(w.model, tr, bucket_bytes=64 << 10, chunk_size=64 << 10,
                                         optimizer=w.opt if guarded else None, verify_own=verify_own)
            assert pub.version == 0 and tr.version == 0
            expected = {0: w.published()}
            await fol.wait_version(0)
            _same_bits(fol.state, expected[0])
            for v in range(1, 4):  # lock step: compare every version's bits on the follower
                await asyncio.to_thread(w.step)
                poke(v)
                assert await pub.publish() == v
                await pub.flush()  # with the guard, extraction may still run: flush waits for it
                expected[v] = w.published()
                await fol.wait_version(v)
                _same_bits(fol.state, expected[v])
                _same_bits(tr.state, expected[v])
                assert fol.fingerprint == tr.fingerprint == pub.fingerprints[v] == tr.state.audit()
            seen = []

            async def watch():
                async for m in fol.subscribe():
                    seen.append((m.target_version, m.target_fingerprint))
                    if m.target_version == 8:
                        return

            watcher = asyncio.create_task(watch(), name="watch")
            for v in range(4, 9):  # pipelined: training goes on while earlier versions publish
                await asyncio.to_thread(w.step)
                await pub.publish()
                if not guarded:  # publish returned after extraction: these bits are version v
                    expected[v] = w.published()
            await pub.close()
            await asyncio.wait_for(watcher, 60)
            assert [v for v, _ in seen] == list(range(4, 9))
            for v, fp in seen:
                assert fp == pub.fingerprints[v]
                if v in expected:
                    assert ModelState(expected[v]).fingerprint == fp
            _same_bits(fol.state, w.published())
            _same_bits(tr.state, w.published())
            assert fol.state.audit() == fol.fingerprint == tr.state.audit()
            held = fol.state.tensor("extra").float()
            assert held.isnan().any() and held.isinf().any() and (torch.signbit(held) & (held == 0)).any()
            recs = {r.version: r for r in pub.records}
            assert sorted(recs) == list(range(9))
            assert recs[0].kind == "snapshot" and recs[0].changed_fraction == 1.0
            for v in range(1, 9):
                r = recs[v]
                assert r.kind == "delta" and 0 < r.changed < r.elements
                assert r.full_bytes == sum(t.numel() * t.element_size() for t in w.published().values())
                assert 0 < r.payload_bytes < r.full_bytes
                assert min(r.extract_s, r.encode_s, r.publish_s) >= 0
        finally:
            await fol.close()
            await tr.close()

    asyncio.run(go())


def test_extraction_reads_at_most_one_bucket_and_chunks_do_not_depend_on_it(tmp_path, monkeypatch):
    """Bucket size bounds every device read; the artifacts are the same for any bucket size."""
    priv, tr_cfg, common = _configs(tmp_path)
    reads: list[int] = []
    real_read = Publisher._read

    def counting_read(self, piece, a, b):
        out = real_read(self, piece, a, b)
        reads.append(out.numel() * out.element_size())
        return out

    monkeypatch.setattr(Publisher, "_read", counting_read)

    async def publish_steps(bucket_bytes: int, data_dir: str):
        w = _workload(lr=3e-4)
        cfg = config.with_overrides(tr_cfg, data_dir=data_dir)
        tr = await Node.create(cfg)
        try:
            pub = await Publisher.create(w.model, tr, bucket_bytes=bucket_bytes, chunk_size=64 << 10)
            for _ in range(2):
                await asyncio.to_thread(w.step)
                await pub.publish()
            await pub.close()
            return [(r.fingerprint, r.payload_bytes, r.changed) for r in pub.records]
        finally:
            await tr.close()

    small = asyncio.run(publish_steps(16 << 10, str(tmp_path / "small")))
    assert max(reads) <= 16 << 10
    assert len(reads) > 3 * 24  # the large tensors were read in several buckets
    reads.clear()
    large = asyncio.run(publish_steps(1 << 30, str(tmp_path / "large")))
    assert max(reads) == 512 * 64 * 2  # the embedding in one read
    assert small == large


def test_publish_overlaps_and_pending_versions_are_bounded(tmp_path):
    """publish() returns before the node has the version; a third unpublished version waits."""
    priv, tr_cfg, common = _configs(tmp_path)
    w = _workload()

    async def go():
        tr = await Node.create(tr_cfg)
        try:
            pub = await Publisher.create(w.model, tr, max_pending=2)
            gate = asyncio.Event()
            real = tr.publish

            async def gated(m, chunks, *changes):  # the node is slow to take the artifact (e.g. a busy disk)
                await gate.wait()
                await real(m, chunks, *changes)

            tr.publish = gated
            await asyncio.to_thread(w.step)
            assert await pub.publish() == 1
            await asyncio.to_thread(w.step)
            assert await pub.publish() == 2
            assert tr.version == 0  # training went on; nothing published yet
            await asyncio.to_thread(w.step)
            third = asyncio.create_task(pub.publish(), name="third")
            done, _ = await asyncio.wait({third}, timeout=1.0)
            assert not done  # back-pressure: two versions are pending
            gate.set()
            assert await third == 3
            await pub.close()
            assert tr.version == 3 and tr.fingerprint == pub.fingerprints[3]
            assert ModelState(w.published()).fingerprint == tr.fingerprint
        finally:
            await tr.close()

    asyncio.run(go())


def test_failure_in_background_is_raised_and_nothing_later_is_published(tmp_path):
    """Someone else publishing on the node breaks the chain: typed error, node state untouched."""
    priv, tr_cfg, common = _configs(tmp_path)
    w = _workload()

    async def go():
        tr = await Node.create(tr_cfg)
        try:
            pub = await Publisher.create(w.model, tr)
            await asyncio.to_thread(w.step)
            await pub.publish()
            await pub.flush()
            other = await Publisher.create(build_model("tiny", seed=9), tr)  # restarts the chain: version 2
            assert tr.version == 2
            fp = tr.fingerprint
            await asyncio.to_thread(w.step)
            await pub.publish()  # a delta against version 1: the node refuses it
            with pytest.raises(PublishError) as err:
                await pub.flush()
            assert err.value.version == 2
            assert tr.version == 2 and tr.fingerprint == fp
            with pytest.raises(PublishError):
                await pub.publish()
            await other.close()
            with pytest.raises(PublishError):
                await pub.close()
            with pytest.raises(P2PSyncError):
                await pub.publish()
        finally:
            await tr.close()

    asyncio.run(go())


def test_a_restarted_trainer_adopts_the_version_the_node_holds(tmp_path):
    priv, tr_cfg, common = _configs(tmp_path)
    w = _workload()

    async def go():
        tr = await Node.create(tr_cfg)
        try:
            pub = await Publisher.create(w.model, tr)
            await asyncio.to_thread(w.step)
            await pub.publish()
            await pub.close()
        finally:
            await tr.close()
        tr = await Node.create(tr_cfg)  # same store: reloads version 1
        try:
            await tr.loaded.wait()
            assert tr.version == 1
            again = await Publisher.create(w.model, tr)
            assert again.version == 1 and tr.version == 1 and again.records == []
            await asyncio.to_thread(w.step)
            assert await again.publish() == 2
            await again.close()
            assert tr.fingerprint == ModelState(w.published()).fingerprint
            changed = await Publisher.create(build_model("tiny", seed=5), tr)  # other weights: a new snapshot
            assert changed.version == 3 and changed.records[0].kind == "snapshot"
            await changed.close()
        finally:
            await tr.close()

    asyncio.run(go())


def test_full_weights_publishes_every_version_as_a_full_snapshot_a_follower_takes(tmp_path):
    """The full-weight baseline: each version is a raw snapshot of every weight; the follower holds each bit-exact."""
    _, tr_cfg, common = _configs(tmp_path)
    w = _workload(lr=1e-6)  # an RL learning rate: a delta would be a small fraction of the weights

    async def go():
        tr = await Node.create(tr_cfg)
        fol = await _follower(tmp_path, common, tr.address)
        try:
            pub = await Publisher.create(w.model, tr, chunk_size=64 << 10, full_weights=True)
            await fol.wait_version(0)
            _same_bits(fol.state, w.published())
            kinds = []

            async def watch():
                async for m in fol.subscribe():
                    kinds.append((m.target_version, m.kind, m.base_version))
                    if m.target_version == 3:
                        return

            watcher = asyncio.create_task(watch(), name="watch")
            for v in range(1, 4):
                await asyncio.to_thread(w.step)
                assert await pub.publish() == v
                await pub.flush()
                await fol.wait_version(v)
                _same_bits(fol.state, w.published())
                assert fol.fingerprint == tr.fingerprint == pub.fingerprints[v]
            await pub.close()
            await asyncio.wait_for(watcher, 60)
            assert kinds == [(v, "snapshot", None) for v in range(1, 4)]  # no delta was ever applied
            assert fol.state.audit() == fol.fingerprint
            full = sum(t.numel() * t.element_size() for t in w.published().values())
            recs = {r.version: r for r in pub.records}
            assert sorted(recs) == [0, 1, 2, 3]
            for r in recs.values():
                assert r.kind == "snapshot" and r.full_bytes == full and r.changed_fraction == 1.0
                # raw words plus segment and chunk headers: the full size, not a compressed or sparse one
                assert full <= r.payload_bytes <= full * 1.01, (r.payload_bytes, full)
        finally:
            await fol.close()
            await tr.close()

    asyncio.run(go())


def test_base_free_position_coding_reaches_the_follower_bit_exact_and_an_unknown_one_is_refused(tmp_path):
    """``position_coding="base-free"``: every delta segment codes its positions in one bucket (where
    the default ranks them in several), and the follower still holds the trainer's bits."""
    from p2psync.codec.decode import split_chunk
    from p2psync.codec.encode import encode_delta
    from p2psync.codec.segment import KIND_DELTA, parse_segment
    from p2psync.errors import ConfigError

    _, tr_cfg, common = _configs(tmp_path)
    w = _workload(lr=1e-5)  # sparse enough that its segments stay sparse (denser ones code densely)
    with pytest.raises(ConfigError, match="position_coding"):
        Publisher(w.model, None, position_coding="sorted")

    def buckets(chunks) -> list[int]:
        return [len(parse_segment(s).counts) for c in chunks for s in split_chunk(c) if s[0] == KIND_DELTA]

    async def go():
        tr = await Node.create(tr_cfg)
        fol = await _follower(tmp_path, common, tr.address)
        try:
            pub = await Publisher.create(w.model, tr, chunk_size=64 << 10, position_coding="base-free")
            await fol.wait_version(0)
            states = [ModelState(w.published())]
            for v in (1, 2):
                await asyncio.to_thread(w.step)
                assert await pub.publish() == v
                await pub.flush()
                states.append(ModelState(w.published()))
                await fol.wait_version(v)
                _same_bits(fol.state, w.published())
                assert fol.state.audit() == fol.fingerprint == pub.fingerprints[v]
                art = tr.store.find("delta", v)
                assert art is not None and art.manifest.base_version == v - 1
                got = buckets(tr.store.chunks(art.manifest.artifact_id))
                assert got and set(got) == {1}
            ranked = buckets(encode_delta(states[1], states[2]).chunks)  # the default coding of the same step
            assert max(ranked) > 1
            await pub.close()
        finally:
            await fol.close()
            await tr.close()

    asyncio.run(go())
