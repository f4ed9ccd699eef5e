import os
import sys

import pytest

# numba compiles the codec kernels once and caches them next to the sources.
os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".numba_cache"))
# Engines the tests start derive their placements (no reuse of a placement cache from ~/.cache);
# tests of the cache name their own folder.
os.environ.setdefault("P2PSYNC_PLACEMENT_CACHE", "off")

_exit_status: int | None = None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    # vLLM imports triton, whose nanobind bindings print dozens of "leaked ..." lines at
    # interpreter exit, after pytest's summary. Everything is reported and written by now, so
    # the process ends here with pytest's status and the summary stays the last thing printed.
    if _exit_status is not None and "triton" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status)


@pytest.fixture(autouse=True)
def _node_certificates(monkeypatch, request):
    """A node built in the test's own process (``Node.create``) gets a certificate of the tests' CA
    (:mod:`tlsutil`) in its ``tls.dir`` when it has none, so every in-process node serves and calls
    over mutual TLS as in production. Nodes started as processes get theirs from :mod:`nodeproc`.
    A test module that checks what a node without a certificate does sets ``OWN_CERTIFICATES = True``."""
    from pathlib import Path

    if getattr(request.module, "OWN_CERTIFICATES", False):
        return

    import tlsutil
    from p2psync.transport.tls import Tls

    original = Tls.for_node.__func__

    def for_node(cls, cfg):
        folder = Path(cfg.tls.dir or Path(cfg.data_dir) / "tls")
        if cfg.tls.enabled and not (folder / "node.crt").exists():
            tlsutil.authority().node(cfg.id, cfg.region, folder)
        return original(cls, cfg)

    monkeypatch.setattr(Tls, "for_node", classmethod(for_node))


@pytest.fixture(autouse=True)
def _root_logging():
    """A test that runs the CLI in-process (``main([...])``) installs its handler and level on the
    root logger; both are put back after the test so later tests see logging as pytest set it up."""
    import logging

    root = logging.getLogger()
    saved = (root.level, list(root.handlers))
    yield
    root.setLevel(saved[0])
    root.handlers[:] = saved[1]


_VLLM_LOGGING_LEVEL = os.environ.get("VLLM_LOGGING_LEVEL")


def _vllm_logging_level_put_back() -> None:
    if _VLLM_LOGGING_LEVEL is None:
        os.environ.pop("VLLM_LOGGING_LEVEL", None)
    else:
        os.environ["VLLM_LOGGING_LEVEL"] = _VLLM_LOGGING_LEVEL


@pytest.fixture(autouse=True)
def _vllm_logging_level():
    """Importing trl sets ``VLLM_LOGGING_LEVEL=ERROR`` in this process's environment (``trl._compat``),
    at collection or in a test; every ``vllm serve`` a later test starts would inherit it and log
    nothing at INFO or WARNING, and the tests that read a server's log (a request reaching the engine,
    a warning that must not appear) would wait forever or pass without looking. Put back before and
    after each test."""
    _vllm_logging_level_put_back()
    yield
    _vllm_logging_level_put_back()


def pytest_collection_finish(session: pytest.Session) -> None:
    _vllm_logging_level_put_back()  # a test module that imports trl at collection
