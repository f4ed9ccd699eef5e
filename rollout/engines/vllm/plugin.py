"""vLLM plugin entry point (``vllm.general_plugins`` = ``p2psync = rollout.engines.vllm.plugin:register``).

vLLM runs :func:`register` in each of its processes (front end, engine core,
workers) before a model loads. It registers the ``p2psync`` weight-transfer
backend (:mod:`rollout.engines.vllm.worker.backend`, imported only when chosen) and, on
the CPU platform, turns off vLLM's oneDNN repacking of linear weights: repacked
layers keep a size-0 ``weight`` and compute with a private copy, so an in-place
update could not reach them. Plain weights cost some CPU throughput (measured
-8 % tokens/s on a tiny model, more on larger ones); set
``P2PSYNC_VLLM_KEEP_ONEDNN=1`` to keep repacking (the backend then refuses to
bind those layers, naming them). GPU platforms are not touched.

Quiet start. With ``skip_tokenizer_init`` (token ids in, token ids out, as
p2psync runs vLLM) the API server's chat-template warmup fails by design and
vLLM logs a WARNING with a traceback (``Chat template warmup failed ...
Tokenizer not available``); :func:`register` installs
:class:`SkippedTokenizerWarmup` on that logger, which drops exactly that record.

Adapters. :func:`serve_adapters` lets ``vllm serve`` load LoRA adapter versions from p2psync
streams without a folder (``POST /v1/load_lora_adapter`` with a ``p2psync:<adapter>@<version>``
path) and names them ``<adapter>@v<version>`` and ``<adapter>`` (the newest); docs/ROLLOUT.md.

Owner watch. vLLM's engine-core process does not notice that the process that
built the ``LLM`` died without shutting it down (SIGKILL, OOM kill), and its
workers only follow the engine core, so all of them would keep running,
holding memory. The p2psync engine builds its ``LLM`` inside
:func:`owned_processes`, which names the building process in the environment
(:data:`OWNER_ENV`) that vLLM's processes inherit. In every other process that
carries the name, :func:`register` starts a daemon thread that waits for that
process to exit (a pidfd, else polling ``/proc``), then sends this process
SIGTERM (vLLM's own orderly shutdown) and ends it 3 s later whatever happens.
``PR_SET_PDEATHSIG`` is not used: it fires when the *thread* that started the
child exits, and the engine is built from a worker thread. Processes without
the name (a plain ``vllm serve``) start no watch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Iterator

logger = logging.getLogger(__name__)

OWNER_ENV = "P2PSYNC_VLLM_OWNER"
"""``pid:start-time`` of the process whose vLLM processes end when it does (set by :func:`owned_processes`)."""
GRACE_S = 3.0
"""Seconds between the SIGTERM a watch sends its own process and its hard exit."""

_watching: threading.Thread | None = None


def register() -> None:
    """Register the ``p2psync`` backend (idempotent), keep CPU linear weights writable, watch the owner."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if "p2psync" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine("p2psync", "rollout.engines.vllm.worker.backend",
                                                    "P2PSyncWeightTransfer")
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and os.environ.get("P2PSYNC_VLLM_KEEP_ONEDNN", "") != "1":
        import vllm._custom_ops as ops

        ops._supports_onednn = False
    quiet_skipped_tokenizer_warmup()
    serve_adapters()
    watch_owner()


def serve_adapters() -> None:
    """LoRA adapter versions from p2psync streams: ``p2psync:<adapter>@<version>`` paths served
    from memory in the workers (:mod:`rollout.engines.vllm.worker.adapter_source`), their names
    and window in the API server (:mod:`rollout.engines.vllm.served_adapters`)."""
    from rollout.engines.vllm import served_adapters
    from rollout.engines.vllm.worker import adapter_source

    adapter_source.install()
    served_adapters.install()


class SkippedTokenizerWarmup(logging.Filter):
    """Drops vLLM's "Chat template warmup failed" warning when its cause is ``skip_tokenizer_init`` (see
    module doc); every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Chat template warmup failed"):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, ValueError) and "skip_tokenizer_init" in str(exc))


WARMUP_LOGGER = "vllm.renderers.base"
"""The logger of vLLM 0.32's chat-template warmup."""


def quiet_skipped_tokenizer_warmup() -> None:
    """Install :class:`SkippedTokenizerWarmup` on :data:`WARMUP_LOGGER` (idempotent)."""
    log = logging.getLogger(WARMUP_LOGGER)
    if not any(isinstance(f, SkippedTokenizerWarmup) for f in log.filters):
        log.addFilter(SkippedTokenizerWarmup())


# --- owner watch ---------------------------------------------------------------------------
def start_time(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks after boot (tells a reused pid apart); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2:].split()[19])


def _running(pid: int, start: int) -> bool:
    """``pid`` is still the process that started at ``start`` and has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return False
    fields = text[text.rindex(")") + 2:].split()
    return fields[0] not in ("Z", "X") and int(fields[19]) == start


@contextlib.contextmanager
def owned_processes() -> Iterator[None]:
    """vLLM processes started inside the block end when the calling process dies (see module doc)."""
    pid = os.getpid()
    start = start_time(pid)
    if start is None:  # no /proc (not Linux): no watch
        yield
        return
    before = os.environ.get(OWNER_ENV)
    os.environ[OWNER_ENV] = f"{pid}:{start}"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(OWNER_ENV, None)
        else:
            os.environ[OWNER_ENV] = before


def watch_owner() -> threading.Thread | None:
    """Start the owner watch in this process if :data:`OWNER_ENV` names another process (idempotent)."""
    global _watching
    value = os.environ.get(OWNER_ENV, "")
    if not value or _watching is not None:
        return _watching
    try:
        pid_text, _, start_text = value.partition(":")
        pid, start = int(pid_text), int(start_text)
    except ValueError:
        logger.warning("p2psync: ignoring %s=%r (expected pid:start-time)", OWNER_ENV, value)
        return None
    if pid == os.getpid():
        return None  # the owner itself
    _watching = threading.Thread(target=_end_with, args=(pid, start), name="p2psync-owner-watch", daemon=True)
    _watching.start()
    return _watching


def wait_exit(pid: int, start: int, poll_s: float = 0.5) -> None:
    """Return once process ``pid`` (started at ``start``) has exited."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd here (kernel < 5.3, a seccomp filter): poll
        while _running(pid, start):
            time.sleep(poll_s)
        return
    try:
        if _running(pid, start):  # the pidfd is the owner's, not a later process's with its pid
            p = select.poll()
            p.register(fd, select.POLLIN)  # readable once the process has exited
            while not p.poll():
                pass
    finally:
        os.close(fd)


def _end_with(pid: int, start: int) -> None:
    wait_exit(pid, start)
    logger.warning("p2psync: process %d that built this vLLM engine is gone; ending vLLM process %d",
                   pid, os.getpid())
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    os._exit(1)
