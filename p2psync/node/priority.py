"""When and how hard a node decodes what it received: chosen per artifact from what the node sees.

The critical path of a version is the last machine holding it, then the engines serving it.
A node that forwards (it has children) is on the path of every machine below it: whatever
its own decode and apply take from its cores, or from its process's interpreter, while it
still receives or forwards, delays them all. A leaf is on no one's path but its own. So, per
artifact, from the usable cores, the children following this node and the load average,
:func:`choose` decides:

``forward_first``
    Hold every chunk of a pushed delta, and (with children) let the pushes of it down the
    children's streams finish writing (at most :data:`FORWARD_WAIT`), before decoding any of
    it, so that receiving, verifying and forwarding it do not share the cores, or the
    interpreter's lock, with its decode. On for a node with children, on any machine. On for
    a leaf without a spare core too: decoding while receiving then cannot finish the decode
    any sooner (no idle core to overlap onto), and it slows the receipt. Off for a leaf with
    a spare core, which decodes each chunk as it arrives, overlapping decode and transfer.
    It costs at most the push's transfer time before the apply: a few ms for a few MB on a
    fast link.
``threads``
    Chunks decoded at once (and threads of the commit's write): the cores the load average
    leaves free, rounded, at least 1 and at most ``max_threads``. On cores shared by more
    runnable work than cores, more threads only queue behind the others, each with its own
    slice of the model's words in the caches and each a contender with the node's own
    receiving and forwarding.
``nice``
    Decode and apply threads run :data:`DECODE_NICE` steps of ``nice`` below the node's
    other threads (Linux): receiving and forwarding win a contended core, slightly. Not
    more, and not more on a relay: ordering (``forward_first``) already keeps a relay's
    decode off its forwarding, and a thread's share of a contended core against ordinary
    work falls with nice (kernel weights 1024 at nice 0, 335 at 5, 15 at 19), so a
    nice-19 decode on a machine that also generates, or that other work shares, gets
    about 1/70 of a core, and that node serves the version last, seconds late. A thread's
    nice is set once, when it starts (going back up needs privileges), so it is the same
    for every artifact.

Settings given explicitly (``limits.forward_first``, ``limits.decode_threads``,
``limits.decode_nice``) are taken as they are. Pure: no clock, no I/O (the node reads
cores, children and load and passes them in).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

DECODE_NICE = 5
"""Nice steps below the node's other threads for its decode and apply (module doc)."""
FORWARD_WAIT = 1.0
"""Longest a node with children holds its decode back for the pushes of the artifact to them to
finish writing (a child that reads slowly does not hold this node's own apply back for longer)."""


@dataclass(frozen=True)
class DecodeOrder:
    forward_first: bool
    """Hold every pushed chunk before decoding any (module doc)."""
    nice: int
    """Decode threads run this many ``nice`` steps below the node's other threads."""
    threads: int
    """Chunks decoded at once, and threads of the commit's write."""
    why: str
    """What the choice was made from, for the node's log."""


def choose(cores: int, children: int, load: float, max_threads: int, *, forward_first: bool | None = None,
           nice: int | None = None, threads: int | None = None) -> DecodeOrder:
    """How to decode the next artifact (module doc). ``cores``: usable CPUs; ``children``: nodes
    following this one; ``load``: the 1-minute load average; ``max_threads``: the decode pool's
    size. A setting given (not None) is kept as given."""
    cores = max(1, int(cores))
    load = max(0.0, float(load)) if math.isfinite(load) else float(cores)
    free = cores - load
    spare = free >= 1.0  # a core stays idle beside this decode
    relay = children > 0
    ff = (relay or not spare) if forward_first is None else forward_first
    n = DECODE_NICE if nice is None else nice
    t = max(1, min(max_threads, int(free + 0.5))) if threads is None else threads
    why = (f"{cores} cores, load {load:.1f}, {children} {'child' if children == 1 else 'children'}: "
           f"{'forward first' if ff else 'decode as chunks arrive'}, nice +{n}, {t} decode "
           f"{'thread' if t == 1 else 'threads'}")
    return DecodeOrder(ff, n, t, why)


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def load_average() -> float:
    """The 1-minute load average; where the platform has none, as if every core were busy."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return float(usable_cores())
