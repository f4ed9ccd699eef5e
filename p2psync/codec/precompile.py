"""The codec's compiled kernels: built ahead of use, loaded when a process starts, never on an update's path.

The codec's loops are numba functions compiled on first use and cached on disk
(``cache=True``). Compiling all of them takes 15 s on an idle core and minutes on
a loaded machine (docs/BENCHMARKS.md, "First use"); loading the cached ones still
takes 1-4 s per process (unpickling and linking the machine code, plus ``import
torch``). Neither belongs in the path of the first version a process publishes
or applies, so:

- **Ahead of time.** ``p2psync warm`` (:func:`main`) compiles every kernel for
  every word type into the cache: run it when the package is installed or the
  image is built (``tools/bootstrap.sh`` does). The cache is numba's, per user:
  ``NUMBA_CACHE_DIR`` if set, else ``__pycache__`` beside the package's sources
  if that folder is writable, else the user's cache folder
  (``$XDG_CACHE_HOME/numba`` or ``~/.cache/numba``), so an install into a
  read-only folder caches there. The cache is keyed by the source files
  (modification time and size) and the CPU: a new version of the package or
  another machine type compiles once more.
- **At process start.** :func:`start` loads the cached kernels (compiling those
  missing) in a daemon thread: a node when it starts, a
  :class:`~trainer.publisher.Publisher` when it is built, the vLLM backend when
  vLLM builds it in its worker. A first publish or apply that comes earlier waits
  only for the kernels it calls (numba's compile lock), not for the rest.
- **Checked.** :func:`first_use` reports the kernels a block of code loaded or
  compiled: empty for a process's first update once :func:`warm` ran.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import threading
import time
from collections.abc import Collection, Iterable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

KERNEL_MODULES = (
    "p2psync.wordops", "p2psync.codec.simd", "p2psync.codec.kernels", "p2psync.codec.positions",
    "p2psync.codec.context", "p2psync.codec.rice", "p2psync.codec.rans", "p2psync.codec.sparse",
    "p2psync.codec.segbits", "p2psync.codec.segencode", "p2psync.codec.segrans", "p2psync.codec.segdecode",
)
"""Modules whose numba functions make up the codec (those :func:`first_use` watches)."""
CODES = ("BF16", "F16", "F32")
"""Word types the kernels are built for by default (dtype codes)."""

_lock = threading.Lock()
_warmed: set[str] = set()
_started: dict[tuple[str, ...], threading.Thread] = {}


def warm(codes: Iterable[str] = CODES) -> float:
    """Load (or compile) the kernels of encode, decode and apply for ``codes``; seconds taken.

    Once per code and process: a second call returns at once, or waits for a call in progress."""
    t0 = time.perf_counter()
    with _lock:
        todo = tuple(c for c in codes if c not in _warmed)
        if todo:
            from p2psync.codec.decode import warm_up

            warm_up(todo)
            _warmed.update(todo)
    return time.perf_counter() - t0


def start(codes: Iterable[str] = CODES, extra: Any = None, cpus: Collection[int] | None = None
          ) -> threading.Thread:
    """Run :func:`warm` (then ``extra()``, if given) in a daemon thread, on ``cpus`` if given (else
    the caller's); the same thread for the same ``codes`` in one process. A failure is logged: the
    apply path reports its own errors."""
    key = tuple(codes)
    with _lock:
        t = _started.get(key)
        if t is not None:
            return t

        def run() -> None:
            if cpus:
                from p2psync.workers import pin

                pin(cpus)
            try:
                took = warm(key)
                if extra is not None:
                    extra()
                logger.info("codec kernels ready in %.2f s", took)
            except Exception as exc:  # noqa: BLE001 - only a speed-up: the real path reports errors
                logger.warning("codec warm-up failed (the first update will load the kernels): %r", exc)

        t = threading.Thread(target=run, name="p2psync-codec-warm", daemon=True)
        _started[key] = t
    t.start()
    return t


def dispatchers() -> list[Any]:
    """The numba functions of :data:`KERNEL_MODULES` (imports them)."""
    from numba.core.registry import CPUDispatcher

    out = []
    for name in KERNEL_MODULES:
        mod = importlib.import_module(name)
        out += [v for v in vars(mod).values() if isinstance(v, CPUDispatcher)]
    return out


def _overloads() -> dict[str, int]:
    return {f"{d.py_func.__module__}.{d.py_func.__name__}": len(d.overloads) for d in dispatchers()}


@contextlib.contextmanager
def first_use() -> Iterator[list[str]]:
    """Yields a list that, when the block ends, names each kernel the block loaded or compiled
    (one entry per new specialisation; empty: everything it ran was ready)."""
    got: list[str] = []
    before = _overloads()
    try:
        yield got
    finally:
        for name, n in _overloads().items():
            got += [name] * max(0, n - before.get(name, 0))


def cache_stats() -> tuple[int, int]:
    """(specialisations loaded from the cache, compiled) in this process so far."""
    hits = misses = 0
    for d in dispatchers():
        s = d.stats
        hits += sum(s.cache_hits.values())
        misses += sum(s.cache_misses.values())
    return hits, misses


def cache_location() -> str:
    """The folder numba caches the codec's kernels in (for this process's settings and user)."""
    from p2psync.codec import segdecode

    return str(segdecode.decode_body.stats.cache_path)


def main(argv: list[str] | None = None) -> int:
    """``python -m p2psync.codec.precompile [--codes ...]``: the same as ``p2psync warm``."""
    from p2psync.cli import main as cli

    return cli(["warm", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
