"""The coordinator's request bodies: a bad value, however deep, is a 400 naming its field."""

from __future__ import annotations

import pytest

from p2psync.control.bodies import (
    MAX_ITEMS, BadRequest, CompleteBody, LeaseBody, ProgressMany, Report, check_report, parse, parse_response,
)

REPORT = {"work_id": "w1", "lease_id": 3, "response": 0, "offset": 0, "tokens": [1, 2], "logprobs": [-1.0, -0.5],
          "versions": [4, 4]}


@pytest.mark.parametrize("report, text", [
    ({**REPORT, "tokens": [1, "2"]}, "reports.1.tokens.1: must be an integer, got str '2'"),
    ({**REPORT, "lease_id": True}, "reports.1.lease_id: must be an integer, got bool True"),
    ({**REPORT, "finish_reason": ""}, "reports.1.finish_reason: must be a non-empty string of at most 32 chars, got str ''"),
    ({k: v for k, v in REPORT.items() if k != "offset"}, "reports.1.offset: missing (required)"),
    ("not an object", "reports.1: must be a JSON object, got str 'not an object'"),
])
def test_a_bad_report_in_a_batch_is_named_by_its_index_and_field(report, text):
    with pytest.raises(BadRequest) as err:
        parse({"node": "a", "reports": [REPORT, report]}, ProgressMany)
    assert str(err.value) == text


def test_bodies_parse_to_typed_values_and_check_their_ranges():
    many = parse({"node": "a", "reports": [REPORT, {**REPORT, "finish_reason": "stop", "extra": 1}]}, ProgressMany)
    assert many.reports[1] == Report("w1", 3, 0, 0, [1, 2], [-1.0, -0.5], [4, 4], "stop")  # extra keys ignored
    assert parse({"node": "a", "wait": 2}, LeaseBody) == LeaseBody("a", None, 2.0, None)
    for bad, field in (({"max_items": MAX_ITEMS + 1}, "max_items"), ({"wait": float("nan")}, "wait"),
                       ({"version": -1}, "version"), ({"node": ""}, "node"), ({"node": 5}, "node")):
        with pytest.raises(BadRequest, match=f"^{field}: must be "):
            parse({"node": "a", **bad}, LeaseBody)
    with pytest.raises(BadRequest, match=r"^reports\.0: tokens, logprobs and versions differ in length$"):
        check_report(parse({**REPORT, "tokens": [1]}, Report), "reports.0")
    body = parse({"node": "a", "work_id": "w", "lease_id": 1, "responses": {"0": {}}}, CompleteBody)
    with pytest.raises(BadRequest, match=r"^responses\.0\.tokens: missing \(required\)$"):
        parse_response(body.responses["0"], "responses.0")
    got = parse_response({"tokens": [1], "logprobs": [0], "versions": [2], "finish_reason": "stop"}, "responses.0")
    assert (got.tokens, got.logprobs, got.finish_reason) == ([1], [0.0], "stop")
