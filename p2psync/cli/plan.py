"""``p2psync plan``: plan the dissemination tree from a saved network model or from live probes.

``--from MODEL.json`` reads a model (the schema of :mod:`topology.model`).
``--probe URL ...`` / ``--cluster FILE`` contacts live nodes (cluster token
from ``--token-file`` or ``--token``), learns each one's id, region and role
from ``GET /v1/status``, has them measure each other (samples inside a region,
representatives across regions, in rounds of pairs that share no node and no
region pipe: :mod:`p2psync.probe.run`), and writes the measured model
(``--save-measurements``, default ``measurements.json``; ``plan --from`` reads
it back) beside the plan.

Either way it prints the bandwidth matrix and the plan (tree, per-edge
bandwidth, estimated completion), scores the plan in the flow simulator
beside the star, fixed-tier and random baselines and the lower bounds, and
writes the plan JSON.
"""

from __future__ import annotations

import argparse
import sys

# The simulator's cost grows with nodes x chunks; above this the scores are skipped.
SIMULATE_UP_TO = 300


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan", help="plan the relay tree from a network model or from live probes",
        description="Plan the bandwidth-weighted relay tree rooted at the trainer, print it, score it and write plan "
                    "JSON. The network comes from a saved model (--from) or is measured on live nodes "
                    "(--probe / --cluster).",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from", dest="source", metavar="MODEL.json",
                     help="network model (nodes, region figures, measured links) to plan from")
    src.add_argument("--probe", nargs="+", metavar="URL", help="addresses of live nodes to measure (all of them)")
    src.add_argument("--cluster", metavar="FILE",
                     help="file listing the nodes' addresses (one URL per line, or a JSON list) to measure")
    p.add_argument("-o", "--output", metavar="PLAN.json",
                   help="write the plan here (with --probe/--cluster default: plan.json)")
    p.add_argument("--payload-bytes", type=int, default=256 * 2**20, help="artifact size to plan for (default 256 MiB)")
    p.add_argument("--chunk-bytes", type=int, default=4 * 2**20, help="chunk size (default 4 MiB)")
    p.add_argument("--max-degree", type=int, default=8, help="most children per node (default 8)")
    p.add_argument("--seed", type=int, default=0, help="tie-break and sampling seed (default 0)")
    p.add_argument("--no-sim", action="store_true", help="skip the simulated scores")
    g = p.add_argument_group("probing (with --probe or --cluster)")
    g.add_argument("--token-file", metavar="FILE", help="file holding the cluster token (preferred over --token)")
    g.add_argument("--token", help="cluster token (visible in the process list; prefer --token-file)")
    g.add_argument("--tls-dir", metavar="DIR",
                   help="certificate folder to present to https:// nodes (`p2psync cert issue --client`)")
    g.add_argument("--save-measurements", metavar="FILE", default="measurements.json",
                   help="write the measured model here, reusable by --from (default measurements.json)")
    g.add_argument("--config", metavar="NODE.toml",
                   help="take the probe-run defaults from this node config's [probe] section (flags below win)")
    g.add_argument("--probe-bytes", type=int, default=None,
                   help="bytes each measurement downloads (default: [probe] bytes, 8 MiB)")
    g.add_argument("--rtt-samples", type=int, default=None, help="RTT samples per pair (default: [probe], 5)")
    g.add_argument("--intra-peers", type=int, default=None,
                   help="peers each node measures inside its region (default: [probe], 3)")
    g.add_argument("--representatives", type=int, default=None,
                   help="nodes per region that measure across regions (default: [probe], 2)")
    g.add_argument("--parallel", type=int, default=None,
                   help="measurements in flight at once (default: [probe], 64)")
    p.set_defaults(run=run)


def speaks_tls(url: str, timeout: float = 2.0) -> bool:
    """Whether the server at ``url`` (host and port) completes a TLS handshake: a p2psync node
    serves only mutual TLS, and a plain HTTP request to it is dropped without an answer."""
    import socket
    import ssl
    from urllib.parse import urlsplit

    u = urlsplit(url)
    if not u.hostname or not u.port:
        return False
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # only asks whether it speaks TLS; nothing is sent over it
    try:
        with socket.create_connection((u.hostname, u.port), timeout=timeout) as raw, \
                ctx.wrap_socket(raw, server_hostname=u.hostname):
            return True
    except (OSError, ssl.SSLError):
        return False


def _tls_hint(urls: list[str]) -> str | None:
    """For http:// addresses whose node speaks TLS: what to do instead."""
    wrong = [u for u in urls if u.startswith("http://") and speaks_tls(u)]
    if not wrong:
        return None
    return f"{wrong[0]}: node speaks TLS; use https://" + (f" (also {len(wrong) - 1} more)" if len(wrong) > 1 else "")


def read_token(args: argparse.Namespace) -> str:
    """The cluster token from ``--token-file`` or ``--token`` (also ``p2psync ui``'s)."""
    from pathlib import Path

    from p2psync.errors import ConfigError

    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError("token_file", f"cannot read {args.token_file}: {exc.strerror}") from None
    elif args.token:
        token = args.token
    else:
        raise ConfigError("token", "needs the cluster token: --token-file FILE (or --token)")
    if not token:
        raise ConfigError("token", "is empty")
    return token


def _probe(args: argparse.Namespace):
    import asyncio

    from p2psync.errors import ConfigError
    from dataclasses import replace

    from p2psync.config import ProbeSettings, load_probe_settings
    from p2psync.probe.run import ProbeOptions, probe, read_cluster_file

    settings = load_probe_settings(args.config) if args.config else ProbeSettings()
    flags = {"bytes": args.probe_bytes, "rtt_samples": args.rtt_samples, "intra_peers": args.intra_peers,
             "representatives": args.representatives, "parallel": args.parallel}
    settings = replace(settings, **{k: v for k, v in flags.items() if v is not None}).validate()
    urls = read_cluster_file(args.cluster) if args.cluster else list(args.probe)
    for u in urls:
        if not u.startswith(("http://", "https://")):
            raise ConfigError("probe", f"{u!r} is not an http(s) URL")
    if any(u.startswith("https://") for u in urls) and not args.tls_dir:
        raise ConfigError("tls-dir", "https:// nodes need a client certificate: --tls-dir DIR "
                                     "(`p2psync cert issue --client --id operator --ca CA_DIR -o DIR`)")
    from p2psync.transport.tls import Tls

    tls = Tls.for_client(args.tls_dir)
    options = ProbeOptions.from_settings(settings, seed=args.seed)

    def progress(i: int, n: int, pairs: int, seconds: float) -> None:
        print(f"probe round {i + 1}/{n}: {pairs} pairs in {seconds:.2f} s", file=sys.stderr, flush=True)

    print(f"probing {len(urls)} nodes ...", file=sys.stderr, flush=True)
    try:
        run_ = asyncio.run(probe(urls, read_token(args), options, on_round=progress, tls=tls))
    except ConfigError:
        hint = _tls_hint([u for u in urls if u.startswith("http://")])
        if hint:
            raise ConfigError("probe", hint) from None
        raise
    for url, err in run_.unreachable:
        if url.startswith("http://") and speaks_tls(url):
            err = "node speaks TLS; use https://"
        print(f"unreachable, left out: {url}: {err}", file=sys.stderr)
    for s, d, err in run_.failed:
        print(f"no figure for {s} -> {d} (estimated instead): {err}", file=sys.stderr)
    print(f"measured {len(run_.measurements)} pairs of {len(run_.members)} nodes in {run_.rounds} rounds, "
          f"{run_.seconds:.1f} s")
    return run_


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from topology.baselines import fixed_tiers_tree, flow_lower_bound, random_tree, star_tree, tree_lower_bound
    from topology.model import NetworkModel
    from topology.planner import PlannerConfig, plan
    from topology.report import format_matrix, format_plan, format_scores
    from topology.simulator import simulate

    probed = None
    if args.source:
        model = NetworkModel.load(args.source)
    else:
        probed = _probe(args)
        model = probed.model
    cfg = PlannerConfig(payload_bytes=args.payload_bytes, chunk_bytes=args.chunk_bytes,
                        max_degree=args.max_degree, seed=args.seed)
    result = plan(model, cfg)
    print(format_matrix(model))
    print()
    print(format_plan(result))
    if not args.no_sim and len(model) <= SIMULATE_UP_TO:
        rows = []
        for name, parents in (
            ("planned tree", result.parents),
            ("star", star_tree(model)),
            ("fixed tiers", fixed_tiers_tree(model)),
            ("random tree", random_tree(model, args.seed, args.max_degree)),
        ):
            rows.append((name, simulate(model, parents, cfg.payload_bytes, cfg.chunk_bytes).makespan_s))
        tree_lb = tree_lower_bound(model, cfg.payload_bytes).completion_s
        rows.append(("lower bound, any tree", tree_lb))
        rows.append(("lower bound, any scheme", flow_lower_bound(model, cfg.payload_bytes).completion_s))
        print()
        print("simulated time until the last node holds the artifact (x the tree lower bound):")
        print(format_scores(rows, tree_lb))
    elif not args.no_sim:
        print(f"\n(simulation skipped: {len(model)} nodes > {SIMULATE_UP_TO}; the estimate above stands)")
    output = args.output or (None if probed is None else "plan.json")
    if probed is not None:
        Path(args.save_measurements).write_text(json.dumps(probed.to_json(), indent=1) + "\n")
        print(f"\nmeasurements written to {args.save_measurements} (plan again with: p2psync plan --from "
              f"{args.save_measurements})")
    if output:
        result.save(output)
        print(f"\nplan written to {output}")
    return 0
