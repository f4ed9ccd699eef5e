"""Typed configuration of a ``p2psync node``: a TOML file plus ``--section.field=value`` overrides.

Layout of the TOML file (every key optional except where a role needs it)::

    id = "relay-a1"
    role = "relay"                 # trainer | relay | rollout
    region = "eu-west"
    data_dir = "/var/lib/p2psync/relay-a1"
    cluster_token = "..."          # or cluster_token_file = "..."
    trainer_public_key = "trainer.pub"
    parents = ["http://10.0.0.1:7070", "http://10.0.0.2:7070"]

    [listen]
    host = "0.0.0.0"
    port = 7070                    # 0: pick a free port (printed on stdout)
    advertise = "http://10.0.0.3:7070"

    [tls]                          # mutually authenticated TLS on every link (on by default)
    dir = "tls"                    # ca.crt, node.crt, node.key from `p2psync cert issue`; default <data_dir>/tls

    [limits]
    parallel_streams = 4
    stall_timeout = 10.0

    [gossip]                       # control plane: membership, live plan, leases
    seeds = ["http://10.0.0.1:7070"]
    interval = 1.0

    [control]
    lease_ttl = 30.0

    [probe]                        # probe endpoints (p2psync.probe.service) and probe-run defaults
    max_blob_bytes = 268435456
    bytes = 8388608                # what one measurement downloads
    intra_peers = 3
    representatives = 2

Validation happens once, in :meth:`NodeConfig.validate`, and raises
:class:`~p2psync.errors.ConfigError` naming the field (``limits.stall_timeout``).
This module imports nothing heavy, so the CLI can parse before it loads torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from p2psync.errors import ConfigError
from p2psync.typed_toml import build, merge, parse_overrides, read_toml

ROLES = ("trainer", "relay", "rollout")
MAX_STREAM_WARMUP = 64 << 20
"""Largest ``limits.stream_warmup_bytes`` (a parent never sends more padding than this per stream)."""


@dataclass
class ListenConfig:
    host: str = "127.0.0.1"
    """Interface to bind."""
    port: int = 0
    """TCP port; 0 lets the OS choose (the node prints the bound address on stdout)."""
    advertise: str = ""
    """URL other nodes use to reach this one; empty: ``http://host:bound_port``."""


@dataclass
class TlsSettings:
    """Mutually authenticated TLS (:mod:`p2psync.transport.tls`, :mod:`p2psync.certs`)."""

    enabled: bool = True
    """Serve and call over TLS, presenting this node's certificate and requiring the peer's (both
    issued by the cluster CA). False: plain HTTP, logged as a warning at start; only on a trusted host."""
    dir: str = ""
    """Folder with ``ca.crt``, ``node.crt`` and ``node.key`` (``p2psync cert issue -o DIR``); the
    certificate must name this node's id and region. Empty: ``<data_dir>/tls``."""
    revoked: str = ""
    """Trainer: a file of revoked node ids, one a line (``p2psync cert revoke`` appends to it),
    re-read every gossip round; the coordinator gossips the list and every node refuses and cuts
    off the revoked ids. Empty: none."""


@dataclass
class LimitsConfig:
    max_header_bytes: int = 8190
    """Longest request line or header field accepted (longer: 400 from the HTTP parser)."""
    max_body_bytes: int = 64 << 10
    """Largest request body accepted; a larger Content-Length gets 413 before it is read."""
    idle_timeout: float = 30.0
    """Seconds a connection may sit without a request, or a response write may block, before it is cut."""
    parallel_streams: int = 4
    """Chunks fetched at once from the parent."""
    stall_timeout: float = 10.0
    """Seconds without progress from a parent before it is replaced by the next candidate."""
    chunk_wait_timeout: float = 10.0
    """Seconds a child waiting for a chunk this node is still fetching waits before getting 503."""
    retry_after: float = 1.0
    """Seconds a failed parent is skipped before it is tried again."""
    avoid_seconds: float = 300.0
    """Seconds a parent that served a corrupt chunk is avoided."""
    max_rest: float = 30.0
    """Longest rest of a failed parent (the rest doubles per failure in a row up to this), and the
    rest of a parent that refused this node for a reason only an operator fixes (a wrong cluster
    token, another CA, revoked) before it is tried again."""
    sse_keepalive: float = 5.0
    """Seconds between keep-alive comments on the head event stream."""
    poll_interval: float = 5.0
    """Seconds between catalogue polls of the parent, a backstop for a lost event."""
    decode_nice: int | None = None
    """Decoding and applying artifacts runs in threads this many steps of ``nice`` below the node
    (Linux, per thread; 0: same priority), so that on cores shared with other nodes or with
    generation, receiving, verifying and forwarding chunks to children come first. Default: 5
    (:mod:`p2psync.node.priority` says why not more)."""
    decode_threads: int | None = None
    """Chunks decoded at once (and threads of the commit's write). Default: the node chooses per
    artifact, the cores not busy by the load average, 1 to ``parallel_streams + 2``
    (:mod:`p2psync.node.priority`)."""
    push_bytes: int = 16 << 20
    """Deltas up to this payload size are pushed whole down a child's open stream (manifest and
    chunks, verified by the child as if pulled: one one-way delay instead of two round trips per
    hop); larger artifacts are pulled. 0: announcements only. Asked for by the child, capped by
    the parent."""
    forward_first: bool | None = None
    """Decode a pushed delta only once every chunk of it is held (else each chunk decodes as it
    arrives), so that receiving and forwarding to children do not compete with this node's
    decode; it costs at most the push's transfer time before the apply (a few ms for a few MB
    on a fast link). Default: the node chooses per artifact, on with children or without a
    spare core, off on a leaf with spare cores (:mod:`p2psync.node.priority`)."""
    stream_warmup_bytes: int = 32 << 20
    """When a child opens its push stream, the parent first sends this many bytes of padding
    (asked for by the child, capped by the parent; 0: none). A new stream's TCP windows start
    small (the sender's congestion window and the receiver's advertised window grow one round
    trip at a time), so the first deltas pushed on it would take several round trips of a WAN
    link; the padding opens both once per connection, off the critical path. 32 MiB: a few
    bandwidth-delay products of a 200 Mbit/s link with 100 ms one way, which a BBR sender needs
    to measure its full rate (:mod:`p2psync.transport.push`). The windows stay
    open across idle gaps only where ``net.ipv4.tcp_slow_start_after_idle`` is 0 on the sender
    (see :mod:`p2psync.transport.push`, "TCP windows")."""


@dataclass
class StoreConfig:
    keep_deltas: int = 64
    """Newest deltas always kept; older ones go once a newer snapshot or state checkpoint covers them."""
    snapshot_interval: int = 10
    """Trainer: sign a snapshot manifest every this many versions (0: never)."""
    snapshot_chunk_size: int = 1 << 20
    """Chunk size of trainer-signed snapshots (raw, so any node holding the weights can rebuild them)."""
    materialise_snapshots: bool | None = None
    """Rebuild trainer-signed snapshots from the weights held; default: relays and the trainer."""
    hold_weights: bool | None = None
    """Apply every artifact to a decoded copy of the weights in this node's memory. Default: the
    trainer and relays always do (they sign or rebuild snapshots from it); a rollout node does
    until a rollout engine in its process has loaded them (``rollout.worker``), then drops its
    copy. False: never (e.g. a vLLM server outside the process pulls from this node). Without
    the copy the node's engine applies the verified artifacts itself, while the node keeps the
    signed artifacts (on disk, bounded by retention), relays them and follows the version chain
    by the manifests' signed fingerprints; late joiners take snapshots from the trainer, the
    relays, or any node whose store still holds one."""
    snapshot_wait: float = 600.0
    """Longest a rebuilding node waits for the parent to list a signed snapshot manifest it
    announced as pending (the trainer signs one beside its next version: seconds per GB of
    weights); the node's next commit waits with it, the next artifact's transfer does not."""
    checkpoint_interval: int = 10
    """Write the applied state to disk every this many versions (and on shutdown); 0: only on shutdown."""
    checkpoint_on_exit: bool = True
    """Write the applied state to disk when ``p2psync node`` stops (SIGTERM/SIGINT or the job
    ended) if it moved since the last checkpoint: seconds per GB of weights. Off: exit at once;
    a restart then rebuilds the state from the last checkpoint and the delta chain the store
    kept after it (retention keeps that chain), or fetches it again."""
    cache_bytes: int = 128 << 20
    """Memory for the most recently stored or read verified chunks, so that children (cut-through)
    are served without reading each chunk back from disk and hashing it again; 0: none."""
    fsync: bool = False
    """fsync every file before it is renamed into place (durable across power loss, slower)."""


@dataclass
class TestingConfig:
    """Switches that make a node misbehave on purpose, for tests; never set them in production."""

    __test__ = False  # not a pytest test class, despite the name
    corrupt_served_chunks: bool = False
    """TEST ONLY: flip a byte in every chunk this node serves, to exercise detection by children."""
    serve_delay: float = 0.0
    """TEST ONLY: seconds to sleep before serving each chunk, to make a transfer last long enough to kill."""


@dataclass
class GossipSettings:
    """The gossip control plane (:mod:`p2psync.control.gossip_service`)."""

    enabled: bool | None = None
    """Run gossip; default: on when ``seeds`` are given or the node is the trainer."""
    seeds: list[str] = field(default_factory=list)
    """URLs of nodes to join through (any live member will do; usually the trainer)."""
    coordinator: str = ""
    """Node id of the coordinator (the trainer); empty: trust the first trainer seen. Entries it
    writes must carry a trainer-key signature either way."""
    node_class: str = "reserved"
    """``reserved``, ``on-demand`` or ``preemptible``: the scheduler keeps reserved nodes busy first."""
    fanout: int = 2
    """Peers each round opens an exchange with."""
    interval: float = 1.0
    """Seconds between gossip rounds."""
    suspect_after: float = 10.0
    """Seconds without heartbeat progress before a watcher suspects a member."""
    dead_after: float = 20.0
    """Seconds a member stays suspect without refuting before it is declared dead."""
    tombstone_ttl: float = 300.0
    """Seconds dead/left members and empty lease entries are remembered before removal."""
    report_interval: float = 10.0
    """A member re-sends its versions and throughput to the coordinator at least this often."""
    report_budget: float = 200.0
    """Reports a second the coordinator takes from all members together, on average: each member
    spaces its reports (new versions included) at least ``live members / report_budget`` seconds
    apart. 0: no bound (each new version reported on the next round)."""
    send_timeout: float = 2.0
    """Seconds a gossip POST may take before it is dropped (gossip is fire and forget)."""
    max_body_bytes: int = 1 << 20
    """The largest gossip message (``POST /v1/gossip``) this node takes, instead of
    ``limits.max_body_bytes``; it tells its peers, and keeps what it sends each within theirs. After
    a partition heals each node relearns nearly the whole member table (~2 MB at 10,000 members):
    1 MiB messages carry it in a few exchanges (see :mod:`p2psync.gossip.config`)."""

    def on(self, role: str) -> bool:
        return bool(self.seeds) or role == "trainer" if self.enabled is None else self.enabled


@dataclass
class ControlSettings:
    """Rollout work: leases on the trainer's coordinator, the work client on rollout nodes."""

    lease_ttl: float = 30.0
    """Coordinator: seconds a lease lasts without renewal (holders renew every third of it)."""
    max_staleness: int = 1
    """Coordinator: a node gets work only while its version >= head - max_staleness."""
    replan_delay: float = 0.5
    """Coordinator: seconds membership must be still before the tree is re-planned (batches joins)."""
    coordinator_url: str = ""
    """Rollout: URL of the coordinator; empty: the trainer's address learned from gossip."""
    request_timeout: float = 10.0
    """Rollout: seconds a call to the coordinator may take (a long-poll adds its wait)."""
    max_body_bytes: int = 64 << 20
    """Coordinator: largest control request body (a finished group's responses, a batch of progress
    reports) it accepts, instead of ``limits.max_body_bytes``; rollout nodes split progress batches to
    fit. A group's result is ~30 bytes of JSON per token: 16 responses of 32k tokens are ~16 MB."""


@dataclass
class ProbeSettings:
    """Probe endpoints of a node (:mod:`p2psync.probe.service`) and the defaults of a probe run
    (:mod:`p2psync.probe.run`, ``p2psync plan --probe``)."""

    max_blob_bytes: int = 256 << 20
    """Largest probe download a request may ask this node for; also the most a measurement here pulls per target."""
    max_blob_streams: int = 4
    """Probe downloads served at once; one more gets 503 + ``Retry-After``."""
    max_targets: int = 32
    """Targets in one measure request this node accepts."""
    max_rtt_samples: int = 64
    """RTT samples per target in one measure request this node accepts."""
    connect_timeout: float = 5.0
    """Seconds to open a connection to a probe target."""
    stall_timeout: float = 10.0
    """Seconds a ping or probe download may go without a byte before it counts as failed."""
    min_rate_bps: float = 1e6
    """Bits/s below which a probe download is cut off (it may last ``8 * bytes / min_rate_bps`` plus the timeouts)."""
    bytes: int = 8 << 20
    """Probe run: bytes each measurement downloads (the probe payload)."""
    rtt_samples: int = 5
    """Probe run: RTT samples per measured pair (median and minimum are kept)."""
    intra_peers: int = 3
    """Probe run: peers each node pulls from inside its region (the intra-region sample)."""
    representatives: int = 2
    """Probe run: nodes per region that measure across regions (the trainer first, then relays)."""
    parallel: int = 64
    """Probe run: measurements in flight at once inside one round."""
    measurements: str = ""
    """Trainer: a file ``p2psync plan --probe --save-measurements`` wrote; the coordinator's live plan
    takes node capacities and pair figures from it (read at start). Empty: reported bandwidth and role
    defaults only."""

    def validate(self, prefix: str = "probe.") -> ProbeSettings:
        """Raise :class:`ConfigError` naming the first bad field (``probe.bytes``); return self."""
        ranges: dict[str, tuple[int, int]] = {
            "max_blob_bytes": (1, 1 << 32), "max_blob_streams": (1, 256), "max_targets": (1, 1024),
            "max_rtt_samples": (1, 1024), "bytes": (1, self.max_blob_bytes), "rtt_samples": (1, self.max_rtt_samples),
            "intra_peers": (1, 1024), "representatives": (1, 1024), "parallel": (1, 4096),
        }
        for name, (lo, hi) in ranges.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ConfigError(f"{prefix}{name}", f"must be an integer in {lo}..{hi}, got {v!r}")
        for name in ("connect_timeout", "stall_timeout", "min_rate_bps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise ConfigError(f"{prefix}{name}", f"must be a positive number, got {v!r}")
        if not isinstance(self.measurements, str):
            raise ConfigError(f"{prefix}measurements", "must be a file path")
        return self


@dataclass
class NodeConfig:
    """Everything a node needs to start. Build with :func:`load`; call :meth:`validate` before use."""

    id: str = "node"
    """Node id, unique in the cluster; appears in logs, status and peers' metrics."""
    role: str = "rollout"
    """``trainer`` (root, only publisher), ``relay`` (forwards), or ``rollout`` (applies, may forward)."""
    region: str = "default"
    """Region label; the planner uses it to send each delta once per region."""
    data_dir: str = ""
    """Directory of the version store and state checkpoint (created if missing)."""
    cluster_token: str = ""
    """Shared secret every request must carry as ``Authorization: Bearer <token>``."""
    cluster_token_file: str = ""
    """File holding the cluster token (used when ``cluster_token`` is empty)."""
    trainer_public_key: str = ""
    """PEM file of the trainer's Ed25519 public key; every manifest must verify against it."""
    trainer_private_key: str = ""
    """Trainer only: PEM private key used to sign the snapshot manifests the node makes."""
    parents: list[str] = field(default_factory=list)
    """Candidate parent URLs, most preferred first; the trainer has none."""
    cut_through: bool = True
    """Announce artifacts while still fetching them and serve each chunk once verified (off: only
    complete artifacts are announced; for benchmarks)."""
    listen: ListenConfig = field(default_factory=ListenConfig)
    tls: TlsSettings = field(default_factory=TlsSettings)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    testing: TestingConfig = field(default_factory=TestingConfig)
    gossip: GossipSettings = field(default_factory=GossipSettings)
    control: ControlSettings = field(default_factory=ControlSettings)
    probe: ProbeSettings = field(default_factory=ProbeSettings)

    @property
    def materialise(self) -> bool:
        m = self.store.materialise_snapshots
        return self.role != "rollout" and self.holds_weights if m is None else m

    @property
    def holds_weights(self) -> bool:
        """Whether the node starts with a decoded copy of the weights (see ``store.hold_weights``)."""
        return self.store.hold_weights is not False

    def token(self) -> str:
        if self.cluster_token:
            return self.cluster_token
        try:
            return Path(self.cluster_token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError("cluster_token_file", f"cannot read {self.cluster_token_file}: {exc.strerror}") from None

    def _check_url(self, name: str, url: str) -> None:
        scheme = "https://" if self.tls.enabled else "http://"
        if not url.startswith(scheme):
            why = "TLS is on (tls.enabled)" if self.tls.enabled else "TLS is off (tls.enabled = false)"
            raise ConfigError(name, f"{url!r} must be an {scheme} URL: {why}")

    def validate(self) -> NodeConfig:
        """Raise :class:`ConfigError` for the first invalid field; return self."""
        if not self.id or any(c.isspace() or c in "/\\" for c in self.id):
            raise ConfigError("id", f"must be non-empty without spaces or slashes, got {self.id!r}")
        if self.role not in ROLES:
            raise ConfigError("role", f"must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not self.data_dir:
            raise ConfigError("data_dir", "is required")
        if not self.cluster_token and not self.cluster_token_file:
            raise ConfigError("cluster_token", "is required (or cluster_token_file)")
        if self.cluster_token and len(self.cluster_token) < 8:
            raise ConfigError("cluster_token", "must be at least 8 characters")
        if not self.trainer_public_key:
            raise ConfigError("trainer_public_key", "is required: every node verifies manifests")
        if self.trainer_private_key and self.role != "trainer":
            raise ConfigError("trainer_private_key", "only the trainer may hold the signing key")
        if self.store.hold_weights is False and (self.role == "trainer" or self.store.materialise_snapshots):
            raise ConfigError("store.hold_weights", "the trainer, and a node that rebuilds snapshots, hold the weights")
        if self.role == "trainer" and self.parents:
            raise ConfigError("parents", "the trainer is the root and has no parents")
        if self.role != "trainer" and not self.parents:
            raise ConfigError("parents", f"a {self.role} needs at least one candidate parent")
        for p in self.parents:
            self._check_url("parents", p)
        if not 0 <= self.listen.port <= 65535:
            raise ConfigError("listen.port", f"must be 0..65535, got {self.listen.port}")
        if self.listen.advertise:
            self._check_url("listen.advertise", self.listen.advertise)
        if not isinstance(self.tls.enabled, bool):
            raise ConfigError("tls.enabled", f"must be true or false, got {self.tls.enabled!r}")
        lim = self.limits
        for name in ("max_header_bytes", "max_body_bytes", "parallel_streams"):
            if getattr(lim, name) < 1:
                raise ConfigError(f"limits.{name}", "must be at least 1")
        if lim.decode_nice is not None and not 0 <= lim.decode_nice <= 19:
            raise ConfigError("limits.decode_nice", f"must be 0..19, got {lim.decode_nice}")
        if lim.decode_threads is not None and not 1 <= lim.decode_threads <= lim.parallel_streams + 2:
            raise ConfigError("limits.decode_threads",
                              f"must be 1..{lim.parallel_streams + 2} (parallel_streams + 2), got {lim.decode_threads}")
        if lim.max_header_bytes < 256:
            raise ConfigError("limits.max_header_bytes", "must be at least 256")
        for name in ("idle_timeout", "stall_timeout", "chunk_wait_timeout", "retry_after", "avoid_seconds",
                     "max_rest", "sse_keepalive", "poll_interval"):
            if not getattr(lim, name) > 0:
                raise ConfigError(f"limits.{name}", "must be > 0")
        if lim.parallel_streams > 64:
            raise ConfigError("limits.parallel_streams", "must be at most 64")
        if isinstance(lim.push_bytes, bool) or not isinstance(lim.push_bytes, int) or not 0 <= lim.push_bytes <= 1 << 30:
            raise ConfigError("limits.push_bytes", f"must be an integer in 0..{1 << 30}, got {lim.push_bytes!r}")
        w = lim.stream_warmup_bytes
        if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w <= MAX_STREAM_WARMUP:
            raise ConfigError("limits.stream_warmup_bytes", f"must be an integer in 0..{MAX_STREAM_WARMUP}, got {w!r}")
        if self.testing.serve_delay < 0:
            raise ConfigError("testing.serve_delay", "must be >= 0")
        st = self.store
        for name in ("keep_deltas", "snapshot_interval", "checkpoint_interval"):
            if getattr(st, name) < 0:
                raise ConfigError(f"store.{name}", "must be >= 0")
        if not 64 << 10 <= st.snapshot_chunk_size <= 256 << 20:
            raise ConfigError("store.snapshot_chunk_size", "must be between 64 KiB and 256 MiB")
        if not st.snapshot_wait >= 0:
            raise ConfigError("store.snapshot_wait", f"must be >= 0 seconds, got {st.snapshot_wait}")
        if not 0 <= st.cache_bytes <= 1 << 40:
            raise ConfigError("store.cache_bytes", f"must be between 0 and 1 TiB, got {st.cache_bytes}")
        g = self.gossip
        for url in g.seeds:
            self._check_url("gossip.seeds", url)
        if g.node_class not in ("reserved", "on-demand", "preemptible"):
            raise ConfigError("gossip.node_class", f"must be reserved, on-demand or preemptible, got {g.node_class!r}")
        if any(c.isspace() or c in "/\\" for c in g.coordinator):
            raise ConfigError("gossip.coordinator", "must be a node id (no spaces or slashes)")
        if not 1 <= g.fanout <= 16:
            raise ConfigError("gossip.fanout", f"must be 1..16, got {g.fanout}")
        for name in ("interval", "suspect_after", "dead_after", "tombstone_ttl", "report_interval", "send_timeout"):
            if not getattr(g, name) > 0:
                raise ConfigError(f"gossip.{name}", "must be > 0")
        if not g.report_budget >= 0:
            raise ConfigError("gossip.report_budget", f"must be >= 0, got {g.report_budget}")
        if not 64 << 10 <= g.max_body_bytes <= 64 << 20:
            raise ConfigError("gossip.max_body_bytes", f"must be 64 KiB..64 MiB, got {g.max_body_bytes}")
        if g.suspect_after < 2 * g.interval:
            raise ConfigError("gossip.suspect_after", "must be at least two gossip intervals (or every lost "
                                                      "heartbeat is a suspicion)")
        c = self.control
        for name in ("lease_ttl", "request_timeout"):
            if not getattr(c, name) > 0:
                raise ConfigError(f"control.{name}", "must be > 0")
        if c.replan_delay < 0 or c.max_staleness < 0:
            raise ConfigError("control.replan_delay" if c.replan_delay < 0 else "control.max_staleness",
                              "must be >= 0")
        if not 64 << 10 <= c.max_body_bytes <= 1 << 30:
            raise ConfigError("control.max_body_bytes", f"must be 64 KiB..1 GiB, got {c.max_body_bytes}")
        if c.coordinator_url:
            self._check_url("control.coordinator_url", c.coordinator_url)
        self.probe.validate()
        return self


# --- loading -------------------------------------------------------------------------------
def load(path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None,
         **direct: Any) -> NodeConfig:
    """TOML file (optional), then overrides, then ``direct`` keyword values; validated.

    Relative paths in the file (data_dir, keys, token file) are resolved against the file's folder.
    """
    data: dict[str, Any] = {}
    if path is not None:
        data = read_toml(path)
        base = Path(path).resolve().parent
        for key in ("data_dir", "trainer_public_key", "trainer_private_key", "cluster_token_file"):
            if isinstance(data.get(key), str) and data[key] and not Path(data[key]).is_absolute():
                data[key] = str(base / data[key])
        tls = data.get("tls")
        if isinstance(tls, dict):
            for key in ("dir", "revoked"):
                if isinstance(tls.get(key), str) and tls[key] and not Path(tls[key]).is_absolute():
                    tls[key] = str(base / tls[key])
        probe = data.get("probe")
        if isinstance(probe, dict) and isinstance(probe.get("measurements"), str) and probe["measurements"] \
                and not Path(probe["measurements"]).is_absolute():
            probe["measurements"] = str(base / probe["measurements"])
    if overrides:
        data = merge(data, parse_overrides(overrides) if isinstance(overrides, list) else overrides)
    data = merge(data, {k: v for k, v in direct.items() if v is not None})
    return build(NodeConfig, data).validate()


def load_probe_settings(path: str | Path) -> ProbeSettings:
    """The ``[probe]`` section of a node config file (defaults where absent), validated."""
    section = read_toml(path).get("probe", {})
    if not isinstance(section, dict):
        raise ConfigError("probe", "must be a table")
    return build(ProbeSettings, section, "probe.").validate()


def with_overrides(cfg: NodeConfig, **changes: Any) -> NodeConfig:
    """A validated copy with top-level fields replaced."""
    return replace(cfg, **changes).validate()
