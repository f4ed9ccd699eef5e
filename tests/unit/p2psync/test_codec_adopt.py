"""``Applier.adopting``: a delta's changes, already decoded or extracted, take the same checked,
all-or-nothing path as its chunks."""

from __future__ import annotations

import numpy as np
import pytest

from p2psync import artifact, keys
from p2psync.codec.decode import Applier
from p2psync.errors import CodecError, FingerprintMismatch, WrongBase
from p2psync.state import ModelState
from tests.unit.p2psync.test_bad_input import OPTS, make_states, snapshot_of

KEY = keys.generate()


def _delta():
    from p2psync.codec.encode import encode_delta

    base, new = make_states(7)
    enc = encode_delta(base, new, OPTS)
    m = artifact.build_manifest(enc, model_id="m", base_version=1, target_version=2, chunk_size=OPTS.chunk_size,
                                private_key=KEY)
    changes = {}
    for t, spec in enumerate(base.specs):
        pos = np.flatnonzero(base.words(spec.name) != new.words(spec.name))
        changes[t] = (pos, new.words(spec.name)[pos].copy())
    return base, new, m, changes


def _same(a: ModelState, b: ModelState) -> bool:
    return all(np.array_equal(a.words(n), b.words(n)) for n in a)


@pytest.mark.parametrize("with_sums", [False, True])
def test_adopted_changes_land_bit_exact(with_sums: bool):
    base, new, m, changes = _delta()
    sums = new.tensor_sums() if with_sums else None
    ap = Applier.adopting(base, m, changes, sums)
    assert ap.adopted
    assert ap.commit() == m.target_fingerprint == new.fingerprint
    assert _same(base, new)
    assert base.audit() == new.fingerprint


def test_adopted_changes_with_a_wrong_word_write_nothing():
    base, _, m, changes = _delta()
    before = snapshot_of(base)
    pos, vals = changes[0]
    vals = vals.copy()
    vals[0] ^= 1
    changes[0] = (pos, vals)
    ap = Applier.adopting(base, m, changes)
    with pytest.raises(FingerprintMismatch):
        ap.commit()
    assert all(np.array_equal(base.words(n), w) for n, w in before.items())


def test_adopted_sums_that_do_not_reach_the_target_write_nothing():
    base, _, m, changes = _delta()
    before = snapshot_of(base)
    ap = Applier.adopting(base, m, changes, base.tensor_sums())  # the base's sums: not the target
    with pytest.raises(FingerprintMismatch):
        ap.commit()
    assert all(np.array_equal(base.words(n), w) for n, w in before.items())


def test_adopting_onto_another_base_or_no_weights_is_refused():
    base, new, m, changes = _delta()
    with pytest.raises(WrongBase):
        Applier.adopting(new, m, changes)
    with pytest.raises(WrongBase):
        Applier.adopting(None, m, changes)


def test_weights_changed_between_adopt_and_commit_are_refused():
    base, new, m, changes = _delta()
    ap = Applier.adopting(base, m, changes)
    w = base.words(base.specs[0].name)
    w[0] ^= 1
    base.invalidate()
    after = snapshot_of(base)
    with pytest.raises(WrongBase):
        ap.commit()
    assert all(np.array_equal(base.words(n), w) for n, w in after.items())


@pytest.mark.parametrize("bad", ["tensor", "position", "width", "shape"])
def test_malformed_changes_get_a_codec_error(bad: str):
    base, _, m, changes = _delta()
    before = snapshot_of(base)
    pos, vals = changes[0]
    if bad == "tensor":
        changes = {len(base.specs): (pos, vals)}
    elif bad == "position":
        changes[0] = (np.append(pos, base.specs[0].numel), np.append(vals, vals[:1]))
    elif bad == "width":
        changes[0] = (pos, vals.astype(np.uint64))
    else:
        changes[0] = (pos, vals[:-1])
    with pytest.raises(CodecError):
        Applier.adopting(base, m, changes)
    assert all(np.array_equal(base.words(n), w) for n, w in before.items())
