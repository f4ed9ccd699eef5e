"""The testbed's pure parts: description, address plan, build commands, delay line, planner model."""

from __future__ import annotations

import ipaddress
import json
import struct
import subprocess
import sys

import pytest

from p2psync.errors import ConfigError
from p2psync.testbed import netns
from p2psync.testbed.config import from_dict, load, scaled
from p2psync.testbed.delay import DelayLine
from p2psync.testbed.errors import TestbedError


def test_default_testbed_is_the_issues_four_by_four():
    cfg = from_dict({})
    ms = cfg.machines()
    assert ms[0].id == "trainer" and ms[0].role == "trainer" and ms[0].uplink_mbit == 1000
    rollouts = [m for m in ms if m.role == "rollout"]
    assert len(rollouts) == 16
    assert {r.name: r.wan_mbit for r in cfg.regions} == {"us-east": 1000, "us-west": 1000, "eu-west": 200,
                                                         "ap-south": 200}
    assert all(m.uplink_mbit == 0 and m.downlink_mbit == 0 for m in rollouts)  # intra-region uncapped
    net = ipaddress.IPv4Network(cfg.subnet)
    ips = [m.ip for m in ms]
    assert len(set(ips)) == len(ips) and all(ipaddress.IPv4Address(ip) in net for ip in ips)
    assert all(ns.startswith(f"{cfg.name}-") for ns in cfg.namespaces())
    assert len(set(cfg.namespaces())) == len(cfg.namespaces()) == 1 + 4 + 17
    assert cfg.one_way_ms("us-east", "eu-west") == cfg.one_way_ms("eu-west", "us-east") == 40
    assert cfg.one_way_ms("eu-west", "eu-west") == 0


def test_path_capacity_is_the_tightest_cap_on_the_route():
    cfg = from_dict({})
    t = cfg.machine("trainer")
    assert cfg.path_mbit(t, cfg.machine("eu-west-0")) == 200
    assert cfg.path_mbit(t, cfg.machine("us-west-0")) == 1000
    assert cfg.path_mbit(cfg.machine("eu-west-0"), cfg.machine("eu-west-1")) == float("inf")


@pytest.mark.parametrize("data, field", [
    ({"name": "Bad-Name"}, "name"),
    ({"subnet": "8.8.0.0/16"}, "subnet"),
    ({"subnet": "10.1.2.0/24"}, "subnet"),
    ({"mtu": 500}, "mtu"),
    ({"regions": []}, "regions"),
    ({"regions": [{"name": "a"}, {"name": "a"}], "trainer_region": "a"}, "regions[1].name"),
    ({"regions": [{"name": "a", "wan_mbit": -1}], "trainer_region": "a"}, "regions[0].wan_mbit"),
    ({"regions": [{"name": "a", "nodes": "4"}], "trainer_region": "a"}, "regions[0].nodes"),
    ({"regions": [{"name": "a", "colour": 1}], "trainer_region": "a"}, "regions[0].colour"),
    ({"trainer_region": "mars"}, "trainer_region"),
    ({"latency": [{"a": "us-east", "b": "mars", "ms": 3}]}, "latency"),
    ({"latency": [{"a": "us-east", "b": "us-east", "ms": 3}]}, "latency[0].b"),
    ({"prices": {"reserved": -1}}, "prices.reserved"),
    ({"regions": [{"name": "a", "node_class": "spot"}], "trainer_region": "a"}, "regions[0].node_class"),
    ({"bogus": 1}, "bogus"),
])
def test_invalid_descriptions_name_the_field(data, field):
    with pytest.raises(ConfigError) as ei:
        from_dict(data)
    assert ei.value.field == field


def test_toml_and_json_files_describe_the_same_testbed(tmp_path):
    toml = tmp_path / "wan.toml"
    toml.write_text('name = "tbx"\ntrainer_region = "a"\n[[regions]]\nname = "a"\nwan_mbit = 500\nnodes = 2\n'
                    '[[regions]]\nname = "b"\nwan_mbit = 50\nnodes = 3\nnode_class = "preemptible"\n'
                    '[[latency]]\na = "a"\nb = "b"\nms = 25\n[prices]\npreemptible = 1.5\n')
    cfg = load(toml)
    js = tmp_path / "wan.json"
    js.write_text(json.dumps(cfg.to_dict()))
    again = load(js)
    assert again.to_dict() == cfg.to_dict()
    assert [m.id for m in cfg.machines()] == ["trainer", "a-0", "a-1", "b-0", "b-1", "b-2"]
    assert cfg.one_way_ms("b", "a") == 25 and cfg.prices["preemptible"] == 1.5
    with pytest.raises(ConfigError, match="not valid TOML"):
        (tmp_path / "bad.toml").write_text("name = ")
        load(tmp_path / "bad.toml")


def test_scaled_cuts_regions_and_sets_machines_per_region():
    cfg = scaled(2, 8)
    assert [r.name for r in cfg.regions] == ["us-east", "us-west"]
    assert len(cfg.machines()) == 17
    assert all(a in ("us-east", "us-west") for a, _ in cfg.latency)


def test_build_commands_stay_inside_the_testbed():
    cfg = from_dict({})
    cmds = [c.argv for c in netns.plan_commands(cfg)]
    prefix = f"{cfg.name}-"
    for argv in cmds:
        assert "default" not in argv, argv  # no default route: nothing can leave the testbed
        if argv[:3] == ("ip", "link", "add"):
            # both ends are created directly inside testbed namespaces, never in the host's
            ns_args = [argv[i + 1] for i, a in enumerate(argv) if a == "netns"]
            assert len(ns_args) == 2 and all(n.startswith(prefix) for n in ns_args), argv
        elif argv[:2] in (("ip", "-n"), ("tc", "-n")):
            assert argv[2].startswith(prefix), argv
        elif argv[:3] in (("ip", "netns", "add"), ("ip", "netns", "exec")):
            assert argv[3].startswith(prefix), argv
        else:
            pytest.fail(f"unexpected command {argv}")
    assert sum(1 for a in cmds if a[:3] == ("ip", "netns", "add")) == len(cfg.namespaces())


def test_caps_sit_on_the_sending_side_of_each_capped_link():
    cfg = from_dict({"node_downlink_mbit": 300})
    caps = {}
    for c in netns.plan_commands(cfg):
        if c.argv[0] == "tc":
            ns, dev, rate = c.argv[2], c.argv[c.argv.index("dev") + 1], c.argv[c.argv.index("rate") + 1]
            caps[(ns, dev)] = rate
    assert caps[("p2tb-n-trainer", "eth0")] == "1000000kbit"  # trainer uplink
    assert caps[("p2tb-rt-eu-west", "wan")] == "200000kbit"  # region WAN uplink
    assert caps[("p2tb-core", "r2")] == "200000kbit"  # region WAN downlink
    assert caps[("p2tb-rt-us-west", "n1")] == "300000kbit"  # a machine's downlink
    assert ("p2tb-n-us-west-0", "eth0") not in caps  # rollout uplinks uncapped by default
    burst = int(netns.tbf_args(200, cfg.mtu)[4])
    assert burst >= 2 * cfg.mtu  # a burst smaller than one packet would stall the link


def test_delay_spec_and_routing_cover_every_region_pair():
    cfg = from_dict({})
    spec = netns.delay_spec(cfg)
    pairs = {(a, b): s for a, b, s in spec["delays"]}
    assert len(pairs) == 12 and pairs[(1, 3)] == pytest.approx(0.040) and pairs[(3, 1)] == pytest.approx(0.040)
    rules = [c.argv for c in netns.delay_routing(cfg) if "rule" in c.argv]
    assert [r[r.index("iif") + 1] for r in rules] == ["r0", "r1", "r2", "r3"]
    assert any("blackhole" in c.argv for c in netns.delay_routing(cfg))
    assert netns.delay_spec(from_dict({"default_latency_ms": 0, "latency": []})) is None


def _packet(src: str, dst: str, size: int = 60) -> bytes:
    head = bytes([0x45, 0]) + struct.pack("!H", size) + bytes(8)
    return head + ipaddress.IPv4Address(src).packed + ipaddress.IPv4Address(dst).packed + bytes(size - 20)


def test_delay_line_holds_each_packet_for_its_pairs_delay_in_order():
    base = int(ipaddress.IPv4Address("10.99.0.0"))
    line = DelayLine(base, {(1, 3): 0.040, (3, 1): 0.040, (1, 2): 0.010})
    a = _packet("10.99.1.2", "10.99.3.2")
    b = _packet("10.99.1.2", "10.99.2.2")
    c = _packet("10.99.1.3", "10.99.3.4")
    other = _packet("192.168.0.1", "10.99.3.2")
    v6 = bytes([0x60]) + bytes(59)
    for p in (a, b, c, other, v6):
        assert line.push(p, now=100.0)
    assert line.pop_due(100.0) == [other, v6]  # not the testbed's inter-region traffic: no delay
    assert line.pop_due(100.0099) == []
    assert line.pop_due(100.010) == [b]
    assert line.next_due() == pytest.approx(100.040)
    assert line.pop_due(100.0399) == []
    assert line.pop_due(100.5) == [a, c]  # equal delays keep arrival order
    assert line.queued_bytes == 0 and line.next_due() is None


def test_delay_line_drops_instead_of_growing_past_its_queue():
    line = DelayLine(0x0A630000, {(1, 2): 1.0}, max_queued_bytes=200)
    p = _packet("10.99.1.2", "10.99.2.2", 100)
    assert line.push(p, 0.0) and line.push(p, 0.0)
    assert not line.push(p, 0.0)
    assert line.dropped == 1 and line.queued_bytes == 200


def test_streams_sent_at_once_take_as_long_as_their_most_loaded_link():
    cfg = from_dict({})  # trainer uplink 1 Gbit/s; eu-west and ap-south 200 Mbit/s to the WAN
    ap = [m.id for m in cfg.machines() if m.region == "ap-south"]
    mb = 1e6
    # One stream to ap-south: 8 Mbit over its 200 Mbit/s link.
    assert cfg.concurrent_seconds([("trainer", ap[0])], mb) == pytest.approx(0.04)
    # A relay in ap-south feeding its region: uncapped links inside the region add nothing.
    assert cfg.concurrent_seconds([("trainer", ap[0]), *((ap[0], c) for c in ap[1:])], mb) == pytest.approx(0.04)
    # The star: four streams share ap-south's link, sixteen the trainer's uplink (0.128 s).
    star = [("trainer", m.id) for m in cfg.machines() if m.id != "trainer"]
    assert cfg.concurrent_seconds(star, mb) == pytest.approx(0.16)
    assert cfg.concurrent_seconds([], mb) == 0.0


def test_planner_model_matches_the_caps():
    from p2psync.testbed.model import network_model

    cfg = from_dict({})
    model = network_model(cfg)
    assert model.trainer == "trainer" and len(model) == 17
    assert model.node("trainer").uplink_bps == 1e9
    assert model.link_capacity("us-east", "eu-west") == 200e6
    assert model.rtt("trainer", "ap-south-0") == pytest.approx(0.2)


def test_without_root_the_testbed_refuses_clearly(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(TestbedError, match="needs root"):
        netns.check_host()
    with pytest.raises(TestbedError, match="needs root"):
        netns.up(from_dict({}))


def test_without_iproute2_the_testbed_says_what_to_install(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/ip")
    with pytest.raises(TestbedError, match="tc from iproute2"):
        netns.check_host()


def test_cli_help_answers_without_importing_torch():
    code = ("import sys; from p2psync.cli import build_parser; p = build_parser(); "
            "p.parse_args(['testbed', 'status']); print('torch' in sys.modules, 'aiohttp' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_wan_report_gives_median_and_spread_of_holds_and_applied_over_interleaved_runs(monkeypatch):
    """tools/bench_wan.py's report: one row per method and payload over its runs, with the median,
    min and max of "holds" and "applied", the runs' loads, and a timed-out run counted, not averaged."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "tools"))
    from wan.report import rows_of, spread, targets

    assert spread([0.3, None, 0.1, 0.2]) == {"median": 0.2, "min": 0.1, "max": 0.3, "runs": 3, "failed": 1}
    assert spread([None])["median"] is None
    cfg = from_dict({})
    art = {"delta_bytes": 1_780_000, "snapshot_bytes": 143_000_000}

    def p2p(holds: float, applied: float) -> dict:
        return {"delta": {"announced_to_received_s": holds, "announced_to_applied_s": applied, "bit_exact": True}}

    results = {"p2psync-tree": [{**p2p(0.2, 0.5), "load": 1.0, "rep": 0}, {**p2p(0.4, 0.3), "load": 3.0, "rep": 1},
                                {**p2p(0.3, 0.4), "load": 2.0, "rep": 2}],
               "p2psync-star": [{**p2p(0.6, 0.9), "load": 2.0, "rep": r} for r in range(3)],
               "http-unicast": [{"snapshot": {"seconds": 30.0}, "load": 2.0, "rep": r} for r in range(3)]}
    rows = {(r["method"], r["payload"]): r for r in rows_of(cfg, art, results, 60.0)}
    tree = rows[("p2psync-tree", "delta")]
    assert (tree["seconds"], tree["holds"]["min"], tree["holds"]["max"]) == (0.3, 0.2, 0.4)
    assert (tree["applied_s"], tree["applied"]["min"], tree["applied"]["max"]) == (0.4, 0.3, 0.5)
    assert tree["loads"] == [1.0, 3.0, 2.0] and rows[("http-unicast", "snapshot")]["applied"] is None
    met = {g["target"]: g["met"] for g in targets(list(rows.values()))}
    assert met["tree within 0.6x of the star (delta, holds)"]  # 0.3 / 0.6
    assert met[">= 50x faster than full-weight unicast"]  # 30 / 0.3
    assert not met["delta to the last machine within 1.5x of the lower bound"]  # 0.3 s against 0.171 s


def _tcp(src: str, dst: str, payload: bytes) -> bytes:
    """An IPv4 TCP segment with correct IP and TCP checksums."""
    from p2psync.testbed.delay import _fold

    def csum(data: bytes) -> int:
        if len(data) % 2:
            data += b"\0"
        return ~_fold(sum(struct.unpack(f"!{len(data) // 2}H", data))) & 0xFFFF

    s, d = ipaddress.IPv4Address(src).packed, ipaddress.IPv4Address(dst).packed
    tcp = bytearray(struct.pack("!HHIIBBHHH", 40000, 7070, 1, 0, 5 << 4, 0x18, 65535, 0, 0) + payload)
    struct.pack_into("!H", tcp, 16, csum(s + d + struct.pack("!BBH", 0, 6, len(tcp)) + bytes(tcp)))
    ip = bytearray(struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp), 1, 0, 64, 6, 0, s, d))
    struct.pack_into("!H", ip, 10, csum(bytes(ip)))
    return bytes(ip + tcp)


def _tcp_checksum_ok(packet: bytes) -> bool:
    from p2psync.testbed.delay import _fold

    tcp = packet[20:]
    pseudo = packet[12:20] + struct.pack("!BBH", 0, 6, len(tcp))
    data = pseudo + tcp + (b"\0" if len(tcp) % 2 else b"")
    return _fold(sum(struct.unpack(f"!{len(data) // 2}H", data))) == 0xFFFF


BASE = 0x0A630000  # 10.99.0.0


def test_delay_line_partition_drops_one_direction_only_and_heals():
    from p2psync.testbed.delay import LinkFaults

    line = DelayLine(BASE, {(1, 2): 0.01, (2, 1): 0.01}, faults={(1, 2): LinkFaults(drop=1.0)})
    there, back = _packet("10.99.1.2", "10.99.2.2"), _packet("10.99.2.2", "10.99.1.2")
    assert not any(line.push(there, 0.0) for _ in range(100))
    assert line.push(back, 0.0)
    assert line.fault_dropped == 100 and line.dropped == 0  # counted apart from queue overflow
    assert line.pop_due(1.0) == [back]
    line.set_faults({})
    assert line.push(there, 2.0) and line.pop_due(2.01) == [there]


def test_delay_line_loss_is_the_share_asked_and_repeats_with_the_seed():
    from p2psync.testbed.delay import LinkFaults

    def run(seed: int) -> list[bool]:
        line = DelayLine(BASE, {}, faults={(1, 3): LinkFaults(drop=0.2)}, seed=seed)
        return [line.push(_packet("10.99.1.2", "10.99.3.2"), float(i)) for i in range(5000)]

    a = run(7)
    assert 0.17 < a.count(False) / len(a) < 0.23
    assert run(7) == a and run(8) != a
    # Pairs without faults and traffic outside the testbed pass untouched.
    line = DelayLine(BASE, {}, faults={(1, 3): LinkFaults(drop=1.0)})
    assert line.push(_packet("10.99.3.2", "10.99.1.2"), 0.0) and line.push(_packet("10.98.1.2", "10.98.3.2"), 0.0)


def test_delay_line_reorder_holds_packets_so_later_ones_overtake_them():
    from p2psync.testbed.delay import LinkFaults

    line = DelayLine(BASE, {(1, 2): 0.010}, faults={(1, 2): LinkFaults(reorder=0.3, reorder_s=0.050, delay_s=0.005)},
                     seed=1)
    sent = [_packet("10.99.1.2", "10.99.2.2", 60 + i) for i in range(200)]
    for i, p in enumerate(sent):
        assert line.push(p, now=i * 0.001)
    assert line.pop_due(0.0149) == []  # 10 ms delay + 5 ms extra before anything leaves
    out = line.pop_due(10.0)
    assert sorted(out, key=len) == sent  # nothing lost or duplicated
    assert out != sent  # but not in the order sent
    assert 40 < line.reordered < 80
    late = [i for i, p in enumerate(out) if len(p) - 60 < max(len(q) - 60 for q in out[:i + 1])]
    assert late  # a packet left after one sent later


def test_delay_line_corrupts_tcp_payload_with_a_valid_checksum():
    from p2psync.testbed.delay import LinkFaults, corrupt_tcp_payload

    payload = bytes(range(256)) * 4 + b"x"  # odd length: the last byte is half a 16-bit word
    p = _tcp("10.99.1.2", "10.99.2.2", payload)
    assert _tcp_checksum_ok(p)
    import random

    rng = random.Random(3)
    for _ in range(300):  # every position, even and odd, and the trailing odd byte
        bad = corrupt_tcp_payload(p, rng)
        assert bad is not None and len(bad) == len(p)
        assert bad[:20] == p[:20] and bad[20:36] == p[20:36]  # IP header and TCP ports, seq... untouched
        diff = [i for i in range(40, len(p)) if bad[i] != p[i]]
        assert len(diff) == 1  # one payload byte flipped
        assert _tcp_checksum_ok(bad)  # so the kernel delivers it and the receiver's TLS must catch it
    assert corrupt_tcp_payload(_tcp("10.99.1.2", "10.99.2.2", b""), rng) is None  # a bare ACK: nothing to flip
    assert corrupt_tcp_payload(_packet("10.99.1.2", "10.99.2.2"), rng) is None  # not TCP
    line = DelayLine(BASE, {}, faults={(1, 2): LinkFaults(corrupt=1.0)})
    assert line.push(p, 0.0)
    (out,) = line.pop_due(0.0)
    assert out != p and _tcp_checksum_ok(out) and line.corrupted == 1


def test_link_faults_refuse_nonsense_and_round_trip():
    from p2psync.testbed.delay import LinkFaults

    with pytest.raises(ValueError, match="drop"):
        LinkFaults(drop=1.5)
    with pytest.raises(ValueError, match="delay_s"):
        LinkFaults(delay_s=-1)
    f = LinkFaults(drop=0.1, reorder=0.2, reorder_s=0.03, corrupt=0.01, delay_s=0.2)
    assert LinkFaults.from_json(json.loads(json.dumps(f.to_json()))) == f
    assert LinkFaults().to_json() == {}
