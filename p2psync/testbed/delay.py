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

What it does not emulate: jitter, reordering and random loss (packets leave
in due-time order; loss only comes from the tbf queues overflowing); a packet
that would overflow ``max_queued_bytes`` is dropped, as a full router queue
would. Its cost is per packet, which is why the testbed uses a large MTU.

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
import signal
import struct
import subprocess
import sys
from collections.abc import Mapping

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
TUN_NAME = "dly0"


class DelayLine:
    """Packets in, each with a due time; due packets out in due-time order (FIFO among equals).

    ``delays`` maps (source region index, destination region index) to seconds,
    where a region index is the third octet of an address relative to the
    testbed's /16 (``base``). Packets of other protocols, other subnets or
    unlisted pairs pass with no delay.
    """

    def __init__(self, base: int, delays: Mapping[tuple[int, int], float], max_queued_bytes: int = 256 << 20) -> None:
        self.base = base & 0xFFFF0000
        self.delays = dict(delays)
        self.max_queued_bytes = max_queued_bytes
        self.queued_bytes = 0
        self.dropped = 0
        self.forwarded = 0
        self._heap: list[tuple[float, int, bytes]] = []
        self._seq = 0

    def delay_of(self, packet: bytes) -> float:
        if len(packet) < 20 or packet[0] >> 4 != 4:
            return 0.0
        src, dst = struct.unpack_from("!II", packet, 12)
        if src & 0xFFFF0000 != self.base or dst & 0xFFFF0000 != self.base:
            return 0.0
        return self.delays.get(((src >> 8) & 0xFF, (dst >> 8) & 0xFF), 0.0)

    def push(self, packet: bytes, now: float) -> bool:
        """Queue ``packet``; False (and counted) when the queue is full and it was dropped."""
        if self.queued_bytes + len(packet) > self.max_queued_bytes:
            self.dropped += 1
            return False
        heapq.heappush(self._heap, (now + self.delay_of(packet), self._seq, packet))
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
    line = DelayLine(int(spec["base"]), {(int(a), int(b)): float(s) for a, b, s in spec["delays"]})
    fd = open_tun()
    subprocess.run(["ip", "link", "set", TUN_NAME, "mtu", str(int(spec["mtu"])), "up"], check=True)
    print("ready", flush=True)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(fd, line, stop)

    asyncio.run(run())
    print(json.dumps({"forwarded": line.forwarded, "dropped": line.dropped}), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
