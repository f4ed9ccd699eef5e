"""Version store on disk (atomic, survives reopen, retention) and the catch-up planner."""

from __future__ import annotations

import pytest
import torch

from p2psync import keys
from p2psync.artifact import build_manifest
from p2psync.codec.encode import CodecOptions, encode_delta, encode_snapshot
from p2psync.errors import ChunkHashMismatch, P2PSyncError, SignatureError
from p2psync.state import ModelState
from p2psync.store import ArtifactInfo, VersionStore, plan_catchup

OPTS = CodecOptions(chunk_size=64 << 10)


def _chain(priv, n_deltas: int, numel: int = 60_000):
    """A snapshot of version 0 and ``n_deltas`` signed deltas: [(manifest, chunks, state)]."""
    g = torch.Generator().manual_seed(1)
    state = ModelState({"a": torch.randn(numel, generator=g).to(torch.bfloat16),
                        "b": torch.randn(numel // 3, generator=g).to(torch.bfloat16)})
    enc = encode_snapshot(state, OPTS)
    out = [(build_manifest(enc, model_id="m", target_version=0, chunk_size=OPTS.chunk_size, private_key=priv),
            enc.chunks, state.clone())]
    for v in range(1, n_deltas + 1):
        new = state.clone()
        w = new.words("a")
        w[v * 7::97] ^= 3
        new.invalidate()
        enc = encode_delta(state, new, OPTS)
        out.append((build_manifest(enc, model_id="m", base_version=v - 1, target_version=v,
                                   chunk_size=OPTS.chunk_size, private_key=priv), enc.chunks, new.clone()))
        state = new
    return out


@pytest.fixture(scope="module")
def signed():
    priv = keys.generate()
    return priv, _chain(priv, 4)


def _fill(store, items):
    for m, chunks, _ in items:
        store.add_manifest(m)
        for i, c in enumerate(chunks):
            store.put_chunk(m.artifact_id, i, c)


def test_store_survives_reopen_and_cleans_temporaries(tmp_path, signed):
    priv, items = signed
    store = VersionStore.open(tmp_path, priv.public_key())
    _fill(store, items)
    m = items[2][0]
    (tmp_path / "artifacts" / m.artifact_id / "chunk-0.tmp").write_bytes(b"half a write")
    again = VersionStore.open(tmp_path, priv.public_key())
    assert again.head == 4
    assert again.catalogue() == store.catalogue()
    assert again.read_chunk(m.artifact_id, 0) == items[2][1][0]
    assert not list(tmp_path.rglob("*.tmp"))


def test_store_refuses_foreign_manifests_and_bad_chunks(tmp_path, signed):
    priv, items = signed
    store = VersionStore.open(tmp_path, keys.generate().public_key())
    with pytest.raises(SignatureError):
        store.add_manifest(items[0][0])
    store = VersionStore.open(tmp_path, priv.public_key())
    m, chunks, _ = items[0]
    store.add_manifest(m)
    bad = bytearray(chunks[0])
    bad[10] ^= 1
    with pytest.raises(ChunkHashMismatch):
        store.put_chunk(m.artifact_id, 0, bytes(bad))
    assert not store.has_chunk(m.artifact_id, 0)


def test_bit_rot_on_disk_is_caught_on_read(tmp_path, signed):
    priv, items = signed
    store = VersionStore.open(tmp_path, priv.public_key())
    _fill(store, items[:1])
    aid = items[0][0].artifact_id
    path = tmp_path / "artifacts" / aid / "chunk-0"
    good = bytes(items[0][1][0])
    data = bytearray(path.read_bytes())
    data[5] ^= 0x10
    path.write_bytes(bytes(data))
    # The copy kept in memory when the chunk was stored (and verified) is what gets served...
    assert bytes(store.read_chunk(aid, 0)) == good
    # ...and once it is gone (eviction, restart), the rotten file is caught on its way out.
    store = VersionStore.open(tmp_path, priv.public_key())
    with pytest.raises(ChunkHashMismatch):
        store.read_chunk(aid, 0)
    assert not store.has_chunk(aid, 0)  # dropped, so it is fetched again rather than served
    uncached = VersionStore.open(tmp_path, priv.public_key(), cache_bytes=0)
    uncached.add_manifest(items[0][0])
    uncached.put_chunk(aid, 0, good)
    path.write_bytes(bytes(data))
    with pytest.raises(ChunkHashMismatch):
        uncached.read_chunk(aid, 0)


def test_a_manifest_that_no_longer_verifies_is_dropped_on_open(tmp_path, signed):
    priv, items = signed
    store = VersionStore.open(tmp_path, priv.public_key())
    _fill(store, items[:2])
    aid = items[1][0].artifact_id
    raw = bytearray((tmp_path / "artifacts" / aid / "manifest").read_bytes())
    raw[-1] ^= 1  # flip a signature bit
    (tmp_path / "artifacts" / aid / "manifest").write_bytes(bytes(raw))
    again = VersionStore.open(tmp_path, priv.public_key())
    assert aid not in again.artifacts and again.head == 0


def test_state_checkpoint_round_trips_bit_exact(tmp_path, signed):
    priv, items = signed
    store = VersionStore.open(tmp_path, priv.public_key())
    state = items[3][2]
    store.save_state(state, 3)
    loaded, version = store.load_state()
    assert version == 3 and loaded.audit() == state.audit()


def test_retention_keeps_newest_snapshot_and_chain(tmp_path, signed):
    priv, items = signed
    store = VersionStore.open(tmp_path, priv.public_key())
    _fill(store, items)
    # A second snapshot at version 2 makes the older snapshot and deltas up to 2 redundant.
    enc = encode_snapshot(items[2][2], OPTS)
    snap2 = build_manifest(enc, model_id="m", target_version=2, chunk_size=OPTS.chunk_size, private_key=priv)
    _fill(store, [(snap2, enc.chunks, None)])
    removed = store.prune(keep_deltas=1, pinned=None)
    kinds = {(a.kind, a.target) for a in store.catalogue()}
    assert kinds == {("snapshot", 2), ("delta", 3), ("delta", 4)}
    assert len(removed) == 3
    # A pinned checkpoint older than the snapshot keeps the deltas it needs.
    store2 = VersionStore.open(tmp_path / "b", priv.public_key())
    _fill(store2, items + [(snap2, enc.chunks, None)])
    store2.prune(keep_deltas=0, pinned=1)
    assert ("delta", 2) in {(a.kind, a.target) for a in store2.catalogue()}


# --- planner -----------------------------------------------------------------------------
def _snap(v, size):
    return ArtifactInfo(f"snapshot-none-{v}", "snapshot", None, v, size)


def _delta(b, v, size):
    return ArtifactInfo(f"delta-{b}-{v}", "delta", b, v, size)


CHAIN = [_snap(0, 1000), _delta(0, 1, 50), _delta(1, 2, 50), _delta(2, 3, 50), _snap(3, 900), _delta(3, 4, 50)]


def test_planner_prefers_the_delta_chain_when_it_is_smaller():
    assert [a.id for a in plan_catchup(1, 4, CHAIN)] == ["delta-1-2", "delta-2-3", "delta-3-4"]


def test_planner_takes_snapshot_when_the_chain_costs_more():
    arts = CHAIN + [_delta(4, 5, 2000), _snap(5, 800)]
    assert [a.id for a in plan_catchup(1, 5, arts)] == ["snapshot-none-5"]


def test_joiner_takes_the_cheapest_snapshot_plus_chain():
    assert [a.id for a in plan_catchup(None, 4, CHAIN)] == ["snapshot-none-3", "delta-3-4"]
    cheap_old = [_snap(0, 100)] + CHAIN[1:]
    assert plan_catchup(None, 4, cheap_old)[0].id == "snapshot-none-0"


def test_planner_edge_cases():
    assert plan_catchup(4, 4, CHAIN) == []
    with pytest.raises(P2PSyncError):
        plan_catchup(None, 2, [_delta(0, 1, 5), _delta(1, 2, 5)])  # no snapshot for a node with nothing
    with pytest.raises(P2PSyncError):
        plan_catchup(0, 3, [_delta(0, 1, 5), _delta(2, 3, 5)])  # gap in the chain


def test_catalogue_is_safe_while_a_worker_thread_adds_and_removes_artifacts(tmp_path, signed):
    """Nodes store, prune and materialise snapshots in worker threads while the event loop lists
    the store for its event streams; a listing must never fail with 'dictionary changed size'."""
    import threading
    import time

    priv, items = signed
    store = VersionStore.open(tmp_path, priv.public_key())
    _fill(store, items)
    spare = {f"x{i}": store.artifacts[items[0][0].artifact_id] for i in range(200)}
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            for k, v in spare.items():
                store.artifacts[k] = v
            for k in spare:
                store.artifacts.pop(k, None)

    t = threading.Thread(target=churn, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 1.0
        listed = 0
        while time.monotonic() < deadline:
            store.catalogue()
            store.head
            store.newest_snapshot()
            listed += 1
    finally:
        stop.set()
        t.join(5)
    assert listed > 0
    assert {a.target for a in store.catalogue()} == {0, 1, 2, 3, 4}
