"""Chaos soak on the emulated WAN (root): a trainer publishes continuously while faults hit at random.

    .venv/bin/python tools/chaos.py --json docs/benchmarks/chaos.json      # default: 12 nodes + trainer, 3 regions, ~15 min
    .venv/bin/python tools/chaos.py --short --json /tmp/chaos.json         # CI: 6 nodes + trainer, 3 regions, <= 2.25 min

Builds a testbed (``p2psync.testbed``: a namespace per machine, a router per region, the
delay line between regions), starts a ``p2psync node`` per machine over mutual TLS with gossip
(a relay per region, rollout nodes behind it, the trainer as coordinator), and feeds the
trainer's publish folder with ``p2psync publish`` every ``--publish-every`` seconds: small
safetensors checkpoints with ~1 % of the words changed per version. Rollout nodes run a lease
job (``tools/soak/jobs.py``) so that the coordinator's lease table is busy. Then, episode after
episode until ``--minutes`` run out, faults drawn from ``--seed`` (``tools/soak/schedule.py``):

- ``kill``: SIGKILL of a relay or rollout node, restarted from its data dir after the hold;
- ``restart_trainer``: SIGKILL of the trainer node, restarted from its data dir;
- ``disk_full``: the relay whose data dir is a small tmpfs gets it filled to the last byte;
- ``partition`` / ``loss`` / ``delay`` / ``reorder`` / ``corrupt``: the delay line drops all /
  a share of the packets between two regions, delays them, holds some back so that later ones
  overtake them, or flips a byte of TCP payloads with the checksum patched (TLS must refuse it);
- ``revoke``: ``p2psync cert revoke`` of a rollout node on the trainer's list (publishing pauses
  until every node refuses it, so "after the revocation" is well defined);
- ``late_join``: a node started mid-run with an empty data dir.

After each episode every fault is healed and the tool waits until every live, non-revoked node
holds the trainer's newest version bit-exact (``/v1/status`` of every node, polled from the core
namespace by ``p2psync.testbed.observe --poll``); the time from the heal is the episode's
convergence. The checks (``tools/soak/ledger.py``) and the JSON keys: ``faults`` (count by
kind), ``converged_after_heal_s`` (max), ``not_converged`` (episodes past ``--bound``),
``wrong_bits``, ``revoked_received_after``, ``leases_double_held``, ``versions_lost``, and
what each measures under ``measured``. Exit status 0 when every check holds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from p2psync.errors import P2PSyncError  # noqa: E402
from soak.ledger import Ledger  # noqa: E402
from soak.report import passed, report  # noqa: E402
from soak.schedule import Cast, Fault, Schedule  # noqa: E402
from soak.workload import CLI, Checkpoints, publish  # noqa: E402

TOKEN = "chaos-soak-token-0123456789"
PORT = 7070
PY = sys.executable
NODE_OPTS = ["--limits.stall_timeout=5", "--limits.chunk_wait_timeout=2", "--limits.retry_after=0.3",
             "--limits.sse_keepalive=1", "--limits.poll_interval=1", "--gossip.interval=0.5",
             "--control.replan_delay=0.5", "--control.lease_ttl=10", "--store.snapshot_chunk_size=262144",
             "--store.snapshot_interval=20", "--store.checkpoint_interval=10"]
DISK_MB = 48


def log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Soak:
    """One run: the testbed, the node processes, the publisher, the observer and the ledger."""

    def __init__(self, args: argparse.Namespace) -> None:
        from p2psync.testbed.config import from_dict

        self.args = args
        n = args.nodes_per_region
        self.cfg = from_dict({"name": args.name, "trainer_region": "us-east", "mtu": 65000,
                              "regions": [{"name": "us-east", "wan_mbit": 1000, "nodes": n},
                                          {"name": "us-west", "wan_mbit": 1000, "nodes": n},
                                          {"name": "eu-west", "wan_mbit": 200, "nodes": n}],
                              "latency": [{"a": "us-east", "b": "us-west", "ms": 30},
                                          {"a": "us-east", "b": "eu-west", "ms": 40},
                                          {"a": "us-west", "b": "eu-west", "ms": 70}]})
        self.work = Path(tempfile.mkdtemp(prefix="chaos-", dir=args.workdir))
        self.keys = self.work / "keys"
        self.publish_dir = self.work / "publish"
        self.revoked_list = self.keys / "revoked"
        self.results = self.work / "results.jsonl"
        self.ledger = Ledger()
        self.lock = threading.Lock()
        self.round: dict = {"t": 0.0, "nodes": {}}
        self.round_cv = threading.Condition(self.lock)
        self.procs: dict[str, subprocess.Popen] = {}
        self.live: set[str] = set()
        self.args_of: dict[str, list[str]] = {}
        self.tb = None
        self.observer: subprocess.Popen | None = None
        self.mounted: list[Path] = []
        self.stop = threading.Event()
        self.paused = threading.Event()
        self.publishing = threading.Lock()
        self.publish_errors: list[str] = []
        self.unexpected_exits: list[dict] = []
        self.episodes: list[dict] = []
        self.link_seen: dict = {}
        machines = self.cfg.machines()
        by_region = {r.name: [m.id for m in machines if m.region == r.name and m.role != "trainer"]
                     for r in self.cfg.regions}
        self.relays = [ids[0] for ids in by_region.values()]
        self.cast = Cast(relays=self.relays, rollouts=[i for ids in by_region.values() for i in ids[1:]],
                         disk_relay=by_region["eu-west"][0], revoke=by_region["us-west"][-1],
                         late=by_region["eu-west"][-1], regions=list(by_region))

    # ---- processes -------------------------------------------------------------------------

    def url(self, name: str) -> str:
        return f"https://{self.tb.machines[name].ip}:{PORT}"  # type: ignore[union-attr]

    def node_args(self, name: str) -> list[str]:
        m = self.tb.machines[name]  # type: ignore[union-attr]
        role = "trainer" if m.role == "trainer" else "relay" if name in self.relays else "rollout"
        args = [*CLI, "--log-level", self.args.log_level, "node", "--role", role, "--id", name,
                f"--region={m.region}", f"--listen.host={m.ip}", f"--listen.port={PORT}",
                f"--data_dir={self.work / name}", f"--cluster_token={TOKEN}",
                f"--trainer_public_key={self.keys / 'trainer.pub'}", *NODE_OPTS]
        if role == "trainer":
            conf = self.work / "trainer-job.json"
            conf.write_text(json.dumps({"out": str(self.results), "backlog": 2 * len(self.tb.machines)}))  # type: ignore[union-attr]
            args += [f"--trainer_private_key={self.keys / 'trainer.key'}", f"--publish-dir={self.publish_dir}",
                     f"--tls.revoked={self.revoked_list}", "--job", "tools.soak.jobs:trainer", "--job-config", str(conf)]
        else:
            tr = self.url(self.tb.trainer.id)  # type: ignore[union-attr]
            relay = self.url(next(r for r in self.relays if self.tb.machines[r].region == m.region))  # type: ignore[union-attr]
            args += [f"--gossip.seeds={tr}", "--parents=" + ",".join([relay, tr] if role == "rollout" else [tr])]
            if role == "rollout":
                conf = self.work / "rollout-job.json"
                conf.write_text(json.dumps({"token_delay": 0.1, "report_every": 8}))
                args += ["--job", "tools.soak.jobs:rollout", "--job-config", str(conf)]
        return args

    def start(self, names: list[str], wait: float) -> None:
        """Start ``names`` and return once each printed its address (TimeoutError after ``wait``)."""
        started = {}
        for name in names:
            self.args_of.setdefault(name, self.node_args(name))
            with open(self.work / f"{name}.log", "ab") as err:
                started[name] = self.tb.spawn(name, self.args_of[name], stdout=subprocess.PIPE,  # type: ignore[union-attr]
                                              stderr=err, text=True)
            self.procs[name] = started[name]
        deadline = time.monotonic() + wait
        for name, p in started.items():
            line = self._first_line(p, max(1.0, deadline - time.monotonic()))
            if not line.startswith("http"):
                raise RuntimeError(f"node {name} did not start ({line!r}); see {self.work / f'{name}.log'}")
            with self.lock:
                self.live.add(name)

    @staticmethod
    def _first_line(p: subprocess.Popen, timeout: float) -> str:
        got: list[str] = []
        t = threading.Thread(target=lambda: got.append(p.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        t.start()
        t.join(timeout)
        return got[0].strip() if got else "(no address within the wait)"

    def kill(self, name: str) -> None:
        with self.lock:
            self.live.discard(name)
        p = self.procs[name]
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.wait(30)

    def check_exits(self) -> None:
        """A live node that ended on its own is a finding: record it with its log's tail, start it again."""
        for name in sorted(self.live):
            p = self.procs[name]
            if p.poll() is not None:
                tail = (self.work / f"{name}.log").read_text(errors="replace")[-1500:]
                log(f"{name} exited on its own ({p.returncode}); restarting it")
                self.unexpected_exits.append({"node": name, "code": p.returncode, "log_tail": tail})
                with self.lock:
                    self.live.discard(name)
                self.start([name], 120)

    # ---- publisher and observer ------------------------------------------------------------

    def publish_one(self, ck: Checkpoints) -> None:
        with self.publishing:
            path, fp = ck.save()
            v = self.ledger.latest + 1
            with self.lock:
                self.ledger.publishing(v, fp)
            try:
                got_v, got_fp = publish(path, self.publish_dir, self.keys / "trainer.key", self.tb.env(),  # type: ignore[union-attr]
                                        cli=self.args.publish_cli)
            except (RuntimeError, subprocess.TimeoutExpired, P2PSyncError) as exc:
                with self.lock:
                    self.ledger.withdrawn(v)
                self.publish_errors.append(str(exc)[-300:])
                return
            with self.lock:
                if (got_v, got_fp) != (v, fp):  # the CLI disagrees with the truth: count it as wrong bits
                    log(f"p2psync publish made version {got_v} {got_fp}; the checkpoint is version {v} {fp}")
                    self.ledger.wrong.add(("p2psync-publish", got_v, got_fp))
                self.ledger.published(got_v)
            ck.step()

    def publisher(self, ck: Checkpoints) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            if not self.paused.is_set():
                self.publish_one(ck)
            self.stop.wait(max(0.0, self.args.publish_every - (time.monotonic() - t0)))

    def start_observer(self, seconds: float) -> None:
        names = [m.id for m in self.cfg.machines()]
        self.observer = self.tb.spawn("core", [  # type: ignore[union-attr]
            PY, "-m", "p2psync.testbed.observe", "--token", TOKEN, "--poll", str(self.args.poll),
            "--timeout", str(seconds), "--leases", self.tb.trainer.id,  # type: ignore[union-attr]
            f"--tls-dir={self.client_tls}", *(f"{n}={self.url(n)}" for n in names)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(self.work / "observer.log", "ab"), text=True)
        threading.Thread(target=self._read_rounds, name="observer", daemon=True).start()

    def _read_rounds(self) -> None:
        assert self.observer is not None and self.observer.stdout is not None
        for line in self.observer.stdout:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            with self.round_cv:
                self.ledger.observe(r["nodes"], r.get("leases"))
                self.round = r
                self.round_cv.notify_all()

    def wait_converged(self, since: float, bound: float) -> tuple[float | None, dict]:
        """Seconds from ``since`` until a status round (started after ``since``) shows every live node at the
        newest version published at ``since``, bit-exact; (None, why) after ``bound``."""
        with self.round_cv:
            target = self.ledger.latest
            deadline = since + bound
            while True:
                r = self.round
                if r["t"] >= since and self.ledger.converged(r["nodes"], self.live, target):
                    return round(r["t"] - since, 2), {}
                left = deadline - time.monotonic()
                if left <= 0:
                    return None, {"target": target, "laggards": self.ledger.laggards(r["nodes"], self.live, target)}
                self.round_cv.wait(min(left, 2.0))

    def head_as(self, name: str) -> dict:
        r = self.tb.run("core", [PY, "-m", "p2psync.testbed.observe", "--token", TOKEN,  # type: ignore[union-attr]
                                 "--head-as", str(self.work / name / "tls"), "--as-id", name, "--timeout", "5",
                                 *(f"{n}={self.url(n)}" for n in sorted(self.live))],
                        capture_output=True, text=True, timeout=60)
        return json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else {}

    # ---- faults ----------------------------------------------------------------------------

    def fill_disk(self, name: str) -> Path:
        """Fill the node's tmpfs data dir to the last byte (unbuffered writes, bounded in count)."""
        filler = self.work / name / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for size in (1 << 20, 4096, 1):
                block = b"\0" * size
                for _ in range((DISK_MB << 20) // size if size > 1 else 4096):
                    try:
                        os.write(fd, block)
                    except OSError:
                        break
        finally:
            os.close(fd)
        return filler

    def link_faults(self, faults: list[Fault]) -> dict:
        from p2psync.testbed.delay import LinkFaults

        out = {}
        for f in faults:
            if f.kind not in ("partition", "loss", "delay", "reorder", "corrupt"):
                continue
            lf = {"partition": LinkFaults(drop=1.0), "loss": LinkFaults(drop=f.level),
                  "delay": LinkFaults(delay_s=f.level), "reorder": LinkFaults(reorder=f.level, reorder_s=0.05),
                  "corrupt": LinkFaults(corrupt=f.level)}[f.kind]
            a, b = f.target.split("|")
            out[(a, b)] = out[(b, a)] = lf
        return out

    def episode(self, faults: list[Fault]) -> dict:
        rec: dict = {"faults": [f.to_json() for f in faults], "t": round(time.monotonic() - self.t_start, 1)}
        log("episode: " + ", ".join(f"{f.kind} {f.target}" for f in faults))
        links = self.link_faults(faults)
        filler = None
        hold = max([f.hold_s for f in faults] + [0.0])
        for f in faults:
            if f.kind in ("kill", "restart_trainer"):
                if f.kind == "restart_trainer":
                    with self.lock:
                        self.ledger.trainer_killed()
                self.kill(f.target)
            elif f.kind == "disk_full":
                filler = self.fill_disk(f.target)
            elif f.kind == "revoke":
                rec.update(self.revoke(f.target))
            elif f.kind == "late_join":
                self.start([f.target], 120)
        if links:
            self.tb.set_link_faults(links)  # type: ignore[union-attr]
        self.stop.wait(hold)
        if links:  # what the delay line did to packets during this episode
            now = self.tb.set_link_faults({})  # type: ignore[union-attr]
            rec["link_counters"] = {k: now[k] - self.link_seen.get(k, 0) for k in
                                    ("forwarded", "fault_dropped", "reordered", "corrupted")}
            self.link_seen = now
        if filler is not None:
            filler.unlink()
        restarted = [f.target for f in faults if f.kind in ("kill", "restart_trainer")]
        if restarted:
            self.start(restarted, 120)
        healed = time.monotonic()
        self.check_exits()
        rec["converged_s"], why = self.wait_converged(healed, self.args.bound)
        if why:
            rec["not_converged"] = why
            log(f"not converged within {self.args.bound} s: {why}")
        else:
            log(f"converged {rec['converged_s']} s after the heal (version {self.ledger.latest})")
        return rec

    def revoke(self, name: str) -> dict:
        """Revoke ``name`` with publishing paused until every live node refuses it."""
        self.paused.set()
        with self.publishing:  # no publish in flight
            out = subprocess.run([*CLI, "cert", "revoke", "--id", name, "--list", str(self.revoked_list)],
                                 capture_output=True, text=True, timeout=60, env=self.tb.env(), check=False)  # type: ignore[union-attr]
            if out.returncode != 0:
                raise RuntimeError(f"cert revoke failed: {out.stderr}")
            t0 = time.monotonic()
            with self.lock:
                self.live.discard(name)
            answers: dict = {}
            while time.monotonic() - t0 < 90:
                answers = self.head_as(name)
                if answers and all(a in (403, "cut") for n, a in answers.items()):
                    break
                time.sleep(1.0)
            with self.lock:
                self.ledger.revoked, self.ledger.revoked_upto = name, self.ledger.latest
        self.paused.clear()
        return {"revoked_upto": self.ledger.revoked_upto, "refused_by_all_s": round(time.monotonic() - t0, 1),
                "answers": answers}

    # ---- the run ---------------------------------------------------------------------------

    def setup(self) -> Checkpoints:
        from p2psync import keys
        from p2psync.certs import Authority
        from p2psync.testbed.runner import Testbed

        keys.write_pair(keys.generate(), self.keys)
        ca = Authority(self.keys)
        self.client_tls = ca.client()
        self.revoked_list.write_text("")
        self.publish_dir.mkdir()
        disk = self.work / self.cast.disk_relay
        disk.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "tmpfs", str(disk)], check=True)
        self.mounted.append(disk)
        self.tb = Testbed.up(self.cfg, self.args.state_dir)
        for m in self.cfg.machines():
            ca.node(m.id, m.region, self.work / m.id / "tls", hosts=[m.ip])
        ck = Checkpoints(self.work / "ckpt", self.args.numel, seed=self.args.seed)
        (self.work / "ckpt").mkdir()
        self.publish_one(ck)  # version 0, a snapshot, before the trainer starts
        return ck

    def run(self) -> dict:
        a = self.args
        t_begin = time.monotonic()
        ck = self.setup()
        first = [self.tb.trainer.id, *self.relays]  # type: ignore[union-attr]
        self.start(first, 240)
        self.start([m.id for m in self.cfg.machines() if m.id not in first and m.id != self.cast.late], 240)
        self.start_observer(a.minutes * 60 + 600)
        self.t_start = time.monotonic()
        setup_s, why = self.wait_converged(time.monotonic(), 240)
        if setup_s is None:
            raise RuntimeError(f"the cluster did not reach version 0 at start: {why}")
        log(f"{len(self.live)} nodes up and at version {self.ledger.latest} after {time.monotonic() - t_begin:.0f} s")
        threading.Thread(target=self.publisher, args=(ck,), name="publisher", daemon=True).start()
        sched = Schedule(self.cast, a.seed, hold=(a.hold_min, a.hold_max))
        chaos_end = t_begin + a.minutes * 60 - a.final_reserve
        while time.monotonic() < chaos_end:
            progress = (time.monotonic() - self.t_start) / max(1.0, chaos_end - self.t_start)
            self.episodes.append(self.episode(sched.next(progress)))
            self.stop.wait(1.0)
        # The end: every fault healed; publishing stops, and every live node must hold the last version.
        self.stop.set()
        with self.publishing:
            pass
        final_s, final_why = self.wait_converged(time.monotonic(), a.bound)
        time.sleep(2 * a.poll)  # one more round of checks on the final state
        return report(self, final_s, final_why, time.monotonic() - t_begin)

    def close(self) -> None:
        # The clean-up runs to its end: a second SIGTERM (``timeout`` forwards the one it got) or
        # Ctrl-C must not leave namespaces, node processes or the tmpfs behind. Every step is bounded.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.stop.set()
        if self.observer is not None and self.observer.poll() is None:
            with contextlib.suppress(OSError):
                self.observer.stdin.close()  # type: ignore[union-attr]
        if self.tb is not None:
            from p2psync.testbed.runner import Testbed

            Testbed.stop([p for p in self.procs.values()], grace=5)
            if self.observer is not None:
                Testbed.stop([self.observer], grace=2)
            try:
                self.tb.down()
            except Exception as exc:  # noqa: BLE001 - still unmount and report
                log(f"testbed down failed: {exc}")
        for d in self.mounted:
            subprocess.run(["umount", "-l", str(d)], check=False)
        if not self.args.keep:
            shutil.rmtree(self.work, ignore_errors=True)
        else:
            log(f"work dir kept: {self.work}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--short", action="store_true", help="CI mode: 2 machines a region, <= 2.25 minutes")
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--minutes", type=float, help="whole run, set-up included (default 15; --short 2.25)")
    ap.add_argument("--nodes-per-region", type=int, help="default 4 (--short 2): 3 regions")
    ap.add_argument("--publish-every", type=float, default=3.0, help="seconds between versions")
    ap.add_argument("--publish-cli", action="store_true",
                    help="run the `p2psync publish` command per version (default: its code in this process)")
    ap.add_argument("--numel", type=int, default=1_500_000, help="bf16 elements of the model (3 MB)")
    ap.add_argument("--bound", type=float, help="convergence bound after a heal, s (default 120; --short 60)")
    ap.add_argument("--poll", type=float, default=1.0, help="seconds between status rounds")
    ap.add_argument("--hold-min", type=float, help="shortest fault, s (default 4; --short 3)")
    ap.add_argument("--hold-max", type=float, help="longest fault, s (default 10; --short 5)")
    ap.add_argument("--final-reserve", type=float, help="seconds kept for the end (default 60; --short 35)")
    ap.add_argument("--name", default=f"ch{os.getpid() % 10**5}", help="testbed name (namespace prefix)")
    ap.add_argument("--state-dir", type=Path, default=None)
    ap.add_argument("--workdir", default=None, help="parent of the run's temporary folder")
    ap.add_argument("--log-level", default="WARNING", help="of the nodes")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (node logs) after the run")
    a = ap.parse_args(argv)
    short = a.short
    for k, default, short_default in (("minutes", 15.0, 2.25), ("nodes_per_region", 4, 2), ("bound", 120.0, 60.0),
                                      ("hold_min", 4.0, 3.0), ("hold_max", 10.0, 5.0),
                                      ("final_reserve", 60.0, 35.0)):
        if getattr(a, k) is None:
            setattr(a, k, short_default if short else default)
    if os.geteuid() != 0:
        print("chaos: needs root (network namespaces, tc, mount)", file=sys.stderr)
        return 2

    def on_term(*_: object) -> None:
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, on_term)
    soak = Soak(a)
    try:
        r = soak.run()
    finally:
        soak.close()
    text = json.dumps(r, indent=1)
    if a.json:
        Path(a.json).write_text(text + "\n")
    summary = {k: r[k] for k in ("faults", "faults_total", "converged_after_heal_s", "not_converged", "wrong_bits",
                                 "revoked_received_after", "leases_double_held", "versions_lost", "wall_s")}
    print(json.dumps(summary), flush=True)
    return 0 if passed(r) else 1


if __name__ == "__main__":
    sys.exit(main())
