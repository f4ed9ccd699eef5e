"""``p2psync testbed up|run|down|status``: the emulated multi-region WAN (needs root and iproute2).

``up`` builds one network namespace per machine, a router per region and a
WAN core, caps links with ``tbf`` and adds the inter-region delays (see
``p2psync/testbed``); ``run`` executes any command inside a machine's
namespace (``{node}``, ``{ip}``, ``{region}``, ``{role}``, ``{trainer_ip}`` in
the command are filled in); ``down`` removes everything the testbed created,
from its state file, also after a crash; ``status`` says what exists.
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("testbed", help="emulated multi-region WAN in network namespaces (root)",
                       description=__doc__.split("\n\n")[0])
    tsub = p.add_subparsers(dest="testbed_command", metavar="ACTION", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--config", metavar="FILE", help="testbed description (TOML, or JSON if it ends in .json)")
        q.add_argument("--name", help="testbed name / namespace prefix (default: the file's, else p2tb)")
        q.add_argument("--state-dir", metavar="DIR", help="where state files live (default /run/p2psync-testbed)")

    q = tsub.add_parser("up", help="build the testbed (removes leftovers of the same name first)")
    common(q)
    q.add_argument("--regions", type=int, help="use only the first N regions")
    q.add_argument("--per-region", type=int, help="machines per region (besides the trainer)")
    q.add_argument("--json", action="store_true", help="print the machines as JSON")
    q = tsub.add_parser("down", help="remove the testbed: its processes, namespaces and state file")
    common(q)
    q = tsub.add_parser("status", help="what exists of the testbed")
    common(q)
    q.add_argument("--json", action="store_true")
    q = tsub.add_parser("run", help="run a command inside machines' namespaces",
                        description="Run CMD inside NODE's namespace (or every machine's with --each), with the "
                                    "repository importable; exits with the command's status (the worst with --each).")
    common(q)
    q.add_argument("node", nargs="?", help="machine id (see `status`), or core, or router:<region>")
    q.add_argument("--each", action="store_true", help="run in every machine's namespace at once")
    q.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    p.set_defaults(run=run)


def _name(args: argparse.Namespace) -> str:
    if args.name:
        return args.name
    if args.config:
        from p2psync.testbed.config import load

        return load(args.config).name
    return "p2tb"


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from p2psync.testbed import netns

    state_dir = Path(args.state_dir) if args.state_dir else None
    action = args.testbed_command
    if action == "up":
        from p2psync.testbed.config import load, scaled

        cfg = load(args.config, name=args.name)
        if args.regions or args.per_region:
            cfg = scaled(args.regions or len(cfg.regions), args.per_region or cfg.nodes_per_region, cfg)
        st = netns.up(cfg, state_dir)
        machines = [{"id": m.id, "region": m.region, "ip": m.ip, "namespace": m.namespace} for m in cfg.machines()]
        if args.json:
            print(json.dumps({"name": cfg.name, "machines": machines, "delay_pid": st["delay_pid"]}, indent=1))
        else:
            print(f"testbed {cfg.name}: {len(machines)} machines in {len(cfg.regions)} regions "
                  f"(state {netns.state_path(cfg.name, state_dir)})")
            for m in machines:
                print(f"  {m['id']:<14} {m['region']:<10} {m['ip']:<15} {m['namespace']}")
        return 0
    name = _name(args)
    if action == "down":
        gone = netns.down(name, state_dir)
        print(f"testbed {name}: removed {len(gone)} namespaces")
        return 0
    if action == "status":
        st = netns.status(name, state_dir)
        if args.json:
            print(json.dumps(st, indent=1))
        elif not st["exists"]:
            extra = f"; leftover namespaces: {', '.join(st['leftovers'])} (`down` removes them)" if st["leftovers"] else ""
            print(f"testbed {name}: not up{extra}")
        else:
            dl = st["delay_line"]
            print(f"testbed {name}: {'up' if st['complete'] and not st['missing'] else 'INCOMPLETE'}; "
                  f"delay line {'none' if dl is None else ('alive' if dl['alive'] else 'DEAD')}; "
                  f"missing namespaces: {', '.join(st['missing']) or 'none'}")
            for r in st["regions"]:
                print(f"  region {r['name']:<10} {r['subnet']:<16} WAN {r['wan_mbit'] or 'uncapped'} Mbit/s")
            for m in st["machines"]:
                print(f"  {m['id']:<14} {m['region']:<10} {m['ip']:<15} {m['role']:<8} {m['class']:<12} "
                      f"{m['processes']} processes")
        return 0
    # run
    from p2psync.testbed.errors import TestbedError
    from p2psync.testbed.runner import Testbed

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else list(args.cmd)
    if args.each and args.node is not None:  # argparse hands the command's first word to NODE
        cmd = [args.node, *cmd]
        args.node = None
    if not cmd:
        raise TestbedError("nothing to run: give the command after `--`")
    if bool(args.node) == bool(args.each):
        raise TestbedError("give exactly one of NODE or --each")
    tb = Testbed.attach(name, state_dir)
    if args.node:
        return tb.run(args.node, cmd).returncode
    procs = [tb.spawn(m, cmd) for m in tb.machines]
    return max(p.wait() for p in procs)
