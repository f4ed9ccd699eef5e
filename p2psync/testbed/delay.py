"""The WAN delay line: holds every inter-region IPv4 packet for its pair's one-way delay.

The kernel here has no ``netem``, so the core router namespace routes every
packet that arrives from a region router into a TUN device (policy rule
``iif r<i> lookup 100``); this process reads each packet, holds it for the
configured one-way delay of (source region, destination region), and writes
it back into the TUN, where the kernel routes it on (rule-free main table)
to the destination region's router. TCP therefore sees the real round-trip
time end to end (slow start, window growth and loss recovery over a long
RTT), unlike a splitting proxy.

It runs at real-time priority (``SCHED_FIFO``, ``--rt-priority``, 0 to turn
off): the emulated machines share the host's cores, and a link must not be
slowed by their CPU (on the 2-core VM, 16 node processes decoding at once
otherwise delay every WAN packet behind them; real links do not queue behind
their hosts' computations). It only waits on the TUN device and its timer, so
it takes the cores for the moments it forwards.

By default it adds no jitter, reordering or random loss (packets leave in
due-time order; loss only comes from the tbf queues overflowing); a packet
that would overflow ``max_queued_bytes`` is dropped, as a full router queue
would. Its cost is per packet, which is why the testbed uses a large MTU.

Faults (the kernel has no ``netem`` to do this): per ordered pair of regions,
:class:`LinkFaults` drops a share of the packets (1.0: a partition), adds a
fixed extra delay, holds a share of them for an extra random delay (so they
leave after packets sent later: reordering) and flips one byte of a share of
the TCP payloads with the TCP checksum patched to match, so that the
corruption is not caught by the kernel but reaches the receiver's TLS, which
must refuse it. Every random choice comes from one seeded RNG. At run time
the line re-reads its ``--control`` file on SIGHUP (``{"faults": [[src, dst,
{...}], ...], "seed": n}``, written by :func:`p2psync.testbed.netns.set_link_faults`)
and writes its counters beside it (``<control>.stats``).

:class:`DelayLine` is the sans-IO core (bytes and ``now`` in, due packets
out); :func:`serve` is the thin adapter over the TUN file descriptor.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import heapq
import json
import os
import random
import signal
import struct
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
TUN_NAME = "dly0"


@dataclass(frozen=True)
class LinkFaults:
    """What goes wrong on one direction of a pair of regions (all off by default)."""

    drop: float = 0.0
    """Share of packets dropped (1.0: nothing gets through, a partition)."""
    delay_s: float = 0.0
    """Extra one-way delay added to every packet, seconds."""
    reorder: float = 0.0
    """Share of packets held an extra random delay of up to ``reorder_s``, so that later ones overtake them."""
    reorder_s: float = 0.0
    corrupt: float = 0.0
    """Share of TCP segments with a payload whose payload gets one byte flipped (checksum patched)."""

    def __post_init__(self) -> None:
        for name in ("drop", "reorder", "corrupt"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}: must be 0..1, got {getattr(self, name)}")
        for name in ("delay_s", "reorder_s"):
            if not 0.0 <= getattr(self, name) <= 60.0:
                raise ValueError(f"{name}: must be 0..60 s, got {getattr(self, name)}")

    def to_json(self) -> dict[str, float]:
        return {k: v for k, v in asdict(self).items() if v}

    @classmethod
    def from_json(cls, d: Mapping[str, float]) -> LinkFaults:
        return cls(**{k: float(v) for k, v in d.items()})


def _fold(total: int) -> int:
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total


def checksum_update(checksum: int, old_word: int, new_word: int) -> int:
    """The Internet checksum after one 16-bit word changed from ``old_word`` to ``new_word`` (RFC 1624, eqn. 3)."""
    return ~_fold((~checksum & 0xFFFF) + (~old_word & 0xFFFF) + new_word) & 0xFFFF


def corrupt_tcp_payload(packet: bytes, rng: random.Random) -> bytes | None:
    """``packet`` with one random byte of its TCP payload flipped and the TCP checksum patched to match
    (the kernel then delivers it; the receiver's TLS must refuse it); None when it is not an IPv4 TCP
    segment with a payload (not fragmented)."""
    if len(packet) < 40 or packet[0] >> 4 != 4 or packet[9] != 6:
        return None
    ihl = (packet[0] & 0x0F) * 4
    frag = struct.unpack_from("!H", packet, 6)[0]
    if frag & 0x3FFF:  # a fragment: its TCP header may not be in it
        return None
    total = min(len(packet), struct.unpack_from("!H", packet, 2)[0])
    if total < ihl + 20:
        return None
    doff = (packet[ihl + 12] >> 4) * 4
    start = ihl + doff
    if start >= total:
        return None
    buf = bytearray(packet)
    pos = rng.randrange(start, total)
    even = pos - ((pos - ihl) & 1)  # the 16-bit word of the TCP segment holding the byte
    old = (buf[even] << 8) | (buf[even + 1] if even + 1 < total else 0)
    buf[pos] ^= rng.randrange(1, 256)
    new = (buf[even] << 8) | (buf[even + 1] if even + 1 < total else 0)
    ck = struct.unpack_from("!H", buf, ihl + 16)[0]
    struct.pack_into("!H", buf, ihl + 16, checksum_update(ck, old, new))
    return bytes(buf)


class DelayLine:
    """Packets in, each with a due time; due packets out in due-time order (FIFO among equals).

    ``delays`` maps (source region index, destination region index) to seconds,
    where a region index is the third octet of an address relative to the
    testbed's /16 (``base``). Packets of other protocols, other subnets or
    unlisted pairs pass with no delay. ``faults`` (same keys; :meth:`set_faults`
    replaces them at run time) drop, delay, reorder or corrupt a pair's packets,
    every random choice drawn from ``random.Random(seed)``, so a run with the
    same packets and the same ``now`` values decides the same.
    """

    def __init__(self, base: int, delays: Mapping[tuple[int, int], float], max_queued_bytes: int = 256 << 20,
                 faults: Mapping[tuple[int, int], LinkFaults] | None = None, seed: int = 0) -> None:
        self.base = base & 0xFFFF0000
        self.delays = dict(delays)
        self.faults: dict[tuple[int, int], LinkFaults] = dict(faults or {})
        self.rng = random.Random(seed)
        self.max_queued_bytes = max_queued_bytes
        self.queued_bytes = 0
        self.dropped = 0
        self.forwarded = 0
        self.fault_dropped = 0
        self.reordered = 0
        self.corrupted = 0
        self._heap: list[tuple[float, int, bytes]] = []
        self._seq = 0

    def set_faults(self, faults: Mapping[tuple[int, int], LinkFaults], seed: int | None = None) -> None:
        """Replace every pair's faults (an empty mapping heals every link); packets queued keep their due time."""
        self.faults = {k: v for k, v in faults.items() if v != LinkFaults()}
        if seed is not None:
            self.rng.seed(seed)

    def counters(self) -> dict[str, int]:
        return {"forwarded": self.forwarded, "dropped": self.dropped, "fault_dropped": self.fault_dropped,
                "reordered": self.reordered, "corrupted": self.corrupted}

    def pair_of(self, packet: bytes) -> tuple[int, int] | None:
        """(source, destination) region index of an IPv4 packet inside the testbed's /16, else None."""
        if len(packet) < 20 or packet[0] >> 4 != 4:
            return None
        src, dst = struct.unpack_from("!II", packet, 12)
        if src & 0xFFFF0000 != self.base or dst & 0xFFFF0000 != self.base:
            return None
        return (src >> 8) & 0xFF, (dst >> 8) & 0xFF

    def delay_of(self, packet: bytes) -> float:
        pair = self.pair_of(packet)
        return 0.0 if pair is None else self.delays.get(pair, 0.0)

    def push(self, packet: bytes, now: float) -> bool:
        """Queue ``packet``; False (and counted) when the queue is full or a fault dropped it."""
        pair = self.pair_of(packet)
        delay = 0.0 if pair is None else self.delays.get(pair, 0.0)
        f = self.faults.get(pair) if pair is not None and self.faults else None
        if f is not None:
            if f.drop and (f.drop >= 1.0 or self.rng.random() < f.drop):
                self.fault_dropped += 1
                return False
            delay += f.delay_s
            if f.reorder and self.rng.random() < f.reorder:
                delay += self.rng.uniform(0.0, f.reorder_s)
                self.reordered += 1
            if f.corrupt and self.rng.random() < f.corrupt:
                bad = corrupt_tcp_payload(packet, self.rng)
                if bad is not None:
                    packet = bad
                    self.corrupted += 1
        if self.queued_bytes + len(packet) > self.max_queued_bytes:
            self.dropped += 1
            return False
        heapq.heappush(self._heap, (now + delay, self._seq, packet))
        self._seq += 1
        self.queued_bytes += len(packet)
        return True

    def pop_due(self, now: float) -> list[bytes]:
        out = []
        while self._heap and self._heap[0][0] <= now:
            _, _, p = heapq.heappop(self._heap)
            self.queued_bytes -= len(p)
            out.append(p)
        self.forwarded += len(out)
        return out

    def next_due(self) -> float | None:
        return self._heap[0][0] if self._heap else None


def read_control(path: Path) -> tuple[dict[tuple[int, int], LinkFaults], int | None, int]:
    """The faults, optional seed and serial number in a control file (missing file: no faults)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}, None, 0
    faults = {(int(a), int(b)): LinkFaults.from_json(f) for a, b, f in data.get("faults", [])}
    seed = data.get("seed")
    return faults, None if seed is None else int(seed), int(data.get("serial", 0))


def write_stats(path: Path, line: DelayLine, serial: int) -> None:
    """Counters and the faults in force, with the serial of the control file they came from."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({**line.counters(), "serial": serial,
                               "faults": [[a, b, f.to_json()] for (a, b), f in line.faults.items()]}))
    os.replace(tmp, path)


def open_tun(name: str = TUN_NAME) -> int:
    """Create the TUN device in this process's network namespace; returns its non-blocking fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


async def serve(fd: int, line: DelayLine, stop: asyncio.Event) -> None:
    """Pump packets between the TUN ``fd`` and ``line`` until ``stop`` is set."""
    loop = asyncio.get_running_loop()
    timer: asyncio.TimerHandle | None = None

    def flush() -> None:
        nonlocal timer
        timer = None
        for p in line.pop_due(loop.time()):
            try:
                os.write(fd, p)
            except BlockingIOError:  # the kernel's TUN queue is full: the packet is lost, as on a wire
                line.dropped += 1
        arm()

    def arm() -> None:
        nonlocal timer
        due = line.next_due()
        if due is None:
            return
        if timer is not None and timer.when() <= due:
            return
        if timer is not None:
            timer.cancel()
        timer = loop.call_at(due, flush)

    def readable() -> None:
        now = loop.time()
        for _ in range(256):  # bounded per wake-up so writes are not starved
            try:
                p = os.read(fd, 65536)
            except BlockingIOError:
                break
            line.push(p, now)
        arm()

    loop.add_reader(fd, readable)
    try:
        await stop.wait()
    finally:
        loop.remove_reader(fd)
        if timer is not None:
            timer.cancel()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="p2psync testbed WAN delay line (runs inside the core namespace)")
    ap.add_argument("--spec", required=True, help="JSON: {base: int, mtu: int, delays: [[src, dst, seconds], ...]}")
    ap.add_argument("--testbed", default="", help="name of the testbed (identifies this process to `down`)")
    ap.add_argument("--control", default="",
                    help="JSON file of link faults, re-read on SIGHUP; counters go to CONTROL.stats")
    ap.add_argument("--seed", type=int, default=0, help="seed of the faults' random choices")
    ap.add_argument("--rt-priority", type=int, default=10,
                    help="SCHED_FIFO priority (1-99) so that busy emulated machines do not slow the links; 0: normal")
    args = ap.parse_args(argv)
    if args.rt_priority:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(args.rt_priority))
        except (OSError, ValueError) as exc:
            print(f"delay line: no real-time priority ({exc}); busy machines will slow the links",
                  file=sys.stderr, flush=True)
    spec = json.loads(args.spec)
    line = DelayLine(int(spec["base"]), {(int(a), int(b)): float(s) for a, b, s in spec["delays"]}, seed=args.seed)
    control = Path(args.control) if args.control else None
    stats = control.with_name(control.name + ".stats") if control else None
    serial = 0

    def reload() -> None:
        nonlocal serial
        assert control is not None and stats is not None
        try:
            faults, seed, serial = read_control(control)
        except (OSError, ValueError, TypeError) as exc:  # a bad file keeps the faults in force
            print(f"delay line: control file {control} refused ({exc}); faults unchanged", file=sys.stderr, flush=True)
        else:
            line.set_faults(faults, seed)
        write_stats(stats, line, serial)

    if control is not None:
        reload()
    fd = open_tun()
    subprocess.run(["ip", "link", "set", TUN_NAME, "mtu", str(int(spec["mtu"])), "up"], check=True)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if control is not None:
            loop.add_signal_handler(signal.SIGHUP, reload)
        print("ready", flush=True)  # after the handlers: a SIGHUP from now on reloads instead of ending it
        await serve(fd, line, stop)

    asyncio.run(run())
    if stats is not None:
        write_stats(stats, line, serial)
    print(json.dumps(line.counters()), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
