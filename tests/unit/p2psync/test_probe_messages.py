"""Probe wire messages: a measure request is validated field by field before anything is measured."""

from __future__ import annotations

import pytest

from p2psync.errors import CodecError
from p2psync.probe.service import (
    MAX_BLOB_BYTES,
    MAX_RTT_SAMPLES,
    MAX_TARGETS,
    MeasureReply,
    MeasureRequest,
    ProbeInputError,
    TargetResult,
)


def test_defaults_and_round_trip():
    r = MeasureRequest.from_json({"targets": ["http://a:1/", "https://b:2"]})
    assert r.targets == ("http://a:1", "https://b:2") and r.bytes > 0 and r.rtt_samples >= 1
    assert MeasureRequest.from_json(r.to_json()) == r
    reply = MeasureReply("n", "eu", "relay", (TargetResult("http://a:1", "a", "us", "trainer", 0.01, 0.005, 1e9,
                                                            100, 0.1), TargetResult("http://b:2", error="down")))
    assert MeasureReply.from_json(reply.to_json()) == reply


@pytest.mark.parametrize("body,field", [
    ([], "<body>"),
    ({}, "targets"),
    ({"targets": "http://a:1"}, "targets"),
    ({"targets": ["http://a:1"] * (MAX_TARGETS + 1)}, "targets"),
    ({"targets": ["file:///etc/passwd"]}, "targets[0]"),
    ({"targets": ["http://a:1", "http://a b"]}, "targets[1]"),
    ({"targets": ["http://a:1"], "bytes": -1}, "bytes"),
    ({"targets": ["http://a:1"], "bytes": MAX_BLOB_BYTES + 1}, "bytes"),
    ({"targets": ["http://a:1"], "bytes": True}, "bytes"),
    ({"targets": ["http://a:1"], "rtt_samples": MAX_RTT_SAMPLES + 1}, "rtt_samples"),
    ({"targets": ["http://a:1"], "rtt_samples": 1.5}, "rtt_samples"),
    ({"targets": ["http://a:1"], "format": 2}, "format"),
    ({"targets": ["http://a:1"], "verbose": True}, "verbose"),
])
def test_bad_requests_name_the_field(body, field):
    with pytest.raises(ProbeInputError) as exc:
        MeasureRequest.from_json(body)
    assert exc.value.field == field and str(exc.value).startswith(field)


def test_malformed_reply_is_a_codec_error():
    for bad in ({"format": 1}, {"format": 9, "node": "n", "region": "r", "role": "x", "results": []}, [],
                {"format": 1, "node": "n", "region": "r", "role": "x", "results": [{"bogus": 1}]}):
        with pytest.raises(CodecError):
            MeasureReply.from_json(bad)


def test_a_node_s_probe_settings_set_the_limits():
    from p2psync.config import ProbeSettings

    tight = ProbeSettings(max_targets=2, max_blob_bytes=1 << 20, max_rtt_samples=3, bytes=1 << 19, rtt_samples=2)
    ok = MeasureRequest.from_json({"targets": ["http://a:1", "http://b:2"]}, tight)
    assert (ok.bytes, ok.rtt_samples) == (1 << 19, 2)  # the section's defaults fill missing fields
    for body, field in (({"targets": ["http://a:1"] * 3}, "targets"),
                        ({"targets": ["http://a:1"], "bytes": (1 << 20) + 1}, "bytes"),
                        ({"targets": ["http://a:1"], "rtt_samples": 4}, "rtt_samples")):
        with pytest.raises(ProbeInputError) as err:
            MeasureRequest.from_json(body, tight)
        assert err.value.field == field
        MeasureRequest.from_json(body)  # within the default limits
