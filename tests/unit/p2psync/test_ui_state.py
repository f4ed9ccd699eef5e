"""The /ui state document and its layout (pure: p2psync.ui.state)."""

from __future__ import annotations

from p2psync.ui.state import build_state, layout


def member(id, region, role="rollout", parent=None, address=True, **kw):
    return {"id": id, "region": region, "role": role, "parent": parent,
            "address": f"http://{id}:1" if address else None, **kw}


def test_live_status_wins_and_the_real_parent_is_drawn():
    members = [member("T", "us", "trainer"), member("r", "eu", "relay", parent="T"),
               member("x", "eu", parent="T", version=3)]  # the plan says T; x really pulls from r
    statuses = {"T": {"version": 5, "role": "trainer", "region": "us"},
                "r": {"version": 5, "parent": "http://T:1/"},
                "x": {"version": 4, "parent": "http://r:1",
                      "transfers": {"delta-4-5": {"chunks_held": 3, "chunks": 12}}}}
    st = build_state("T", members, statuses, {}, 100.0, "cluster")
    by = {n["id"]: n for n in st["nodes"]}
    assert st["head"] == 5 and st["in_sync"] == 2 and st["oldest"] == 4
    assert by["x"]["parent"] == "r" and by["x"]["planned_parent"] == "T"
    assert by["x"]["version"] == 4  # the node's own status beats the cluster view's figure
    assert by["x"]["progress"] == 0.25 and by["x"]["transfers"][0]["chunks_held"] == 3
    assert by["r"]["progress"] is None
    assert [n["depth"] for n in st["nodes"]] == [0, 1, 2] and st["rows"] == 3


def test_unreachable_and_unknown_nodes_are_shown_not_dropped():
    members = [member("T", "us", "trainer"), member("gone", "eu", parent="T"),
               {"id": "seen-1", "parent": "T", "status": "seen", "seen": 2.5}]
    st = build_state("T", members, {"T": {"version": 1}}, {"gone": "TimeoutError"}, 0.0, "children")
    by = {n["id"]: n for n in st["nodes"]}
    assert by["gone"]["status"] == "unreachable" and by["gone"]["error"] == "TimeoutError"
    assert by["seen-1"]["region"] == "?" and by["seen-1"]["status"] == "seen" and by["seen-1"]["parent"] == "T"


def test_edges_only_between_drawn_nodes_and_cycles_do_not_hang():
    members = [member("T", "us", "trainer"), member("a", "us", parent="b"), member("b", "us", parent="a"),
               member("c", "us", parent="nobody"), member("d", "us", parent="d")]
    st = build_state("T", members, {}, {}, 0.0, "cluster")
    by = {n["id"]: n for n in st["nodes"]}
    assert by["c"]["parent"] is None and by["d"]["parent"] is None
    assert all(0.0 <= n["x"] <= 1.0 and 0.0 <= n["y"] <= 1.0 for n in st["nodes"])
    assert by["a"]["depth"] >= 1 and by["b"]["depth"] >= 1


def test_layout_bands_by_region_trainer_first_and_parents_above_children():
    nodes = [{"id": "T", "region": "zz", "parent": None}]
    for r in ("aa", "mm"):
        nodes.append({"id": f"{r}-relay", "region": r, "parent": "T"})
        nodes += [{"id": f"{r}-{i}", "region": r, "parent": f"{r}-relay"} for i in range(3)]
    pos, bands = layout(nodes, "T")
    assert [b["name"] for b in bands] == ["zz", "aa", "mm"]
    assert bands[0]["x0"] == 0.0 and abs(bands[-1]["x1"] - 1.0) < 1e-9
    for b in bands:  # every node inside its region's band
        for n in nodes:
            if n["region"] == b["name"]:
                assert b["x0"] < pos[n["id"]][0] < b["x1"]
    for n in nodes:
        if n["parent"]:
            assert pos[n["parent"]][1] < pos[n["id"]][1]
    # Wider rows get wider bands.
    assert bands[1]["x1"] - bands[1]["x0"] > bands[0]["x1"] - bands[0]["x0"]
