"""What a client sends the p2psync vLLM backend: every malformed field is a TransferInfoError naming it."""

from __future__ import annotations

import logging

import pytest

from p2psync import keys
from p2psync.errors import ConfigError, P2PSyncError
from rollout.engines.vllm.worker.infos import TransferInfoError, init_info, load_public_key, update_info

GOOD = {"url": "http://127.0.0.1:7001", "token": "t0k", "public_key": "keys/trainer.pub"}


@pytest.mark.parametrize("given, field", [
    ({"token": "t", "public_key": "k"}, "init_info.url"),
    ({"url": "http://h:1", "public_key": "k"}, "init_info.token"),
    ({**GOOD, "public_key": ""}, "init_info.public_key"),
    (GOOD, "init_info.public_key"),  # keys/trainer.pub: no such file here
    ({**GOOD, "versoin": 0}, "init_info.versoin"),
    ({**GOOD, "url": 7001}, "init_info.url"),
    ({**GOOD, "url": "127.0.0.1:7001"}, "init_info.url"),
    ({**GOOD, "version": "abc"}, "init_info.version"),
    ({**GOOD, "version": "5"}, "init_info.version"),
    ({**GOOD, "version": -1}, "init_info.version"),
    ({**GOOD, "version": 1.5}, "init_info.version"),
    ({**GOOD, "version": True}, "init_info.version"),
    ({**GOOD, "threads": -1}, "init_info.threads"),
    ({**GOOD, "timeout": "soon"}, "init_info.timeout"),
    ({**GOOD, "timeout": 0}, "init_info.timeout"),
    ({**GOOD, "node_id": 3}, "init_info.node_id"),
    ({**GOOD, "url": "https://127.0.0.1:7001"}, "init_info.tls_dir"),
    ({**GOOD, "tls_dir": "/nonexistent/tls"}, "init_info.tls_dir"),
    ({**GOOD, "tls_dir": 5}, "init_info.tls_dir"),
    ("http://127.0.0.1:7001", "init_info"),
])
def test_malformed_init_info_names_the_field(given, field):
    with pytest.raises(TransferInfoError) as err:
        init_info(given)
    assert err.value.field == field
    assert str(err.value).startswith(field + ": ")
    assert isinstance(err.value, ConfigError) and isinstance(err.value, P2PSyncError)


@pytest.mark.parametrize("given, field", [
    ({}, "update_info.version"),
    ({"version": "abc"}, "update_info.version"),
    ({"version": "5"}, "update_info.version"),
    ({"version": -1}, "update_info.version"),
    ({"version": 2.0}, "update_info.version"),
    ({"version": None}, "update_info.version"),
    ({"version": 5, "extra": 1}, "update_info.extra"),
    ([{"version": 5}], "update_info"),
    ({"version": 5, "stage": 1}, "update_info.stage"),
    ({"version": 5, "stage": "true"}, "update_info.stage"),
    ({"stage": True}, "update_info.version"),
])
def test_malformed_update_info_names_the_field(given, field):
    with pytest.raises(TransferInfoError) as err:
        update_info(given)
    assert err.value.field == field


def test_well_formed_requests_parse(tmp_path):
    keys.write_pair(keys.generate(), tmp_path / "keys")
    good = {**GOOD, "public_key": str(tmp_path / "keys" / "trainer.pub")}
    got = init_info({**good, "url": "http://127.0.0.1:7001/", "version": 0, "threads": 1, "timeout": 5})
    p = got.parent
    assert (p.url, got.version, got.threads, p.timeout, p.node_id) == ("http://127.0.0.1:7001", 0, 1, 5.0, "vllm")
    assert keys.key_id(p.public_key) == keys.key_id(keys.load_public(good["public_key"]))  # read once, here
    assert p.tls is None and "tls_dir" not in p.wire()  # plain HTTP: no certificate folder
    assert init_info(p.wire()).parent.wire() == p.wire()  # what an engine sends on is what it was given
    assert init_info({**good, "threads": 0}).threads == 0  # the default: as many as the update's CPUs
    assert init_info({**good, "version": None}).version is None
    assert update_info({"version": 0}).version == 0
    assert update_info({"version": 0}).stage is False
    assert update_info({"version": 3, "stage": True}) == update_info({"version": 3, "stage": True})
    assert (update_info({"version": 3, "stage": True}).stage, update_info({"version": 3, "stage": False}).stage) == (
        True, False)


def test_public_key_from_a_file_or_pem_text_or_a_typed_refusal(tmp_path):
    keys.write_pair(keys.generate(), tmp_path / "keys")
    pub = tmp_path / "keys" / "trainer.pub"
    assert keys.key_id(load_public_key(str(pub))) == keys.key_id(load_public_key(pub.read_text()))
    with pytest.raises(TransferInfoError) as err:
        load_public_key(str(tmp_path / "missing.pub"))
    assert err.value.field == "init_info.public_key" and "missing.pub" in str(err.value)
    with pytest.raises(TransferInfoError) as err:
        load_public_key("-----BEGIN PUBLIC KEY-----\nnot base64\n-----END PUBLIC KEY-----\n")
    assert err.value.field == "init_info.public_key"
    with pytest.raises(TransferInfoError):
        load_public_key(str(tmp_path / "keys" / "trainer.key"))  # the private key file is not a public key


def test_plugin_drops_only_the_skipped_tokenizer_warmup_warning():
    from rollout.engines.vllm.plugin import WARMUP_LOGGER, quiet_skipped_tokenizer_warmup

    quiet_skipped_tokenizer_warmup()
    quiet_skipped_tokenizer_warmup()  # idempotent
    log = logging.getLogger(WARMUP_LOGGER)
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    h = Keep()
    log.addHandler(h)
    # Other tests in this process may have set the root level (the CLI's --log-level) or
    # configured vLLM's loggers; this test is about the filter, so it pins the level here.
    saved = (log.level, log.disabled)
    log.setLevel(logging.WARNING)
    log.disabled = False
    try:
        for cause in (ValueError("Tokenizer not available when `skip_tokenizer_init=True`"),
                      ValueError("template syntax error")):
            try:
                raise cause
            except ValueError:
                log.warning("Chat template warmup failed", exc_info=True)
        log.warning("something else")
    finally:
        log.removeHandler(h)
        log.setLevel(saved[0])
        log.disabled = saved[1]
    assert seen == ["Chat template warmup failed", "something else"]  # the second warmup failure is real


def test_a_refusal_names_the_nested_field_says_what_was_expected_and_never_echoes_the_token():
    with pytest.raises(TransferInfoError) as err:
        init_info({**GOOD, "version": "5"})
    assert str(err.value) == "init_info.version: must be an integer >= 0, got str '5'"
    with pytest.raises(TransferInfoError) as err:
        update_info({"version": 3, "stage": "yes"})
    assert str(err.value) == "update_info.stage: must be true or false, got str 'yes'"
    with pytest.raises(TransferInfoError) as err:
        init_info({**GOOD, "token": ["s3cret-token"]})
    assert err.value.field == "init_info.token" and "s3cret" not in str(err.value)
