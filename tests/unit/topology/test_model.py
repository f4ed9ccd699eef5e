"""The network model: estimates for unmeasured pairs, JSON round trip, clear errors on bad files."""

from __future__ import annotations

import json

import pytest

from topology.errors import ModelError
from tests.unit.topology.helpers import G, model, node, trainer
from topology.model import Measurement, NetworkModel, NodeSpec, model_from_measurements
from topology.synthetic import synthetic_model


def test_unmeasured_pairs_are_estimated_from_region_figures_and_node_capacities():
    m = model(
        [trainer(), node("a", up=2 * G), node("b", "B", down=0.3 * G), node("c", "B")],
        links=[("a", "c", 0.7 * G, 0.01)],
        regions=("A", "B"),
        region_links=[("A", "B", 0.5 * G, 0.04, 2 * G), ("B", "A", 0.9 * G, 0.04)],
    )
    assert m.bandwidth("a", "c") == 0.7 * G and m.rtt("a", "c") == 0.01  # measured wins
    assert m.bandwidth("a", "b") == 0.3 * G  # capped by b's downlink
    assert m.bandwidth("T", "c") == 0.5 * G  # region link figure
    assert m.bandwidth("c", "a") == 0.9 * G  # the other direction differs
    assert m.bandwidth("b", "c") == 10 * G and m.rtt("b", "c") == 0.0
    assert m.link_capacity("A", "B") == 2 * G and m.link_capacity("B", "A") is None
    assert m.graph.has_edge("a", "c") and not m.graph.has_edge("c", "a")
    assert m.graph.nodes["b"]["region"] == "B"


def test_json_round_trip_keeps_everything(tmp_path):
    m = synthetic_model(3, 4, seed=7, measured_fraction=0.3)
    path = tmp_path / "model.json"
    m.save(path)
    back = NetworkModel.load(path)
    assert back.to_json() == m.to_json()
    for a in m.node_ids:
        for b in m.node_ids:
            if a != b:
                assert back.bandwidth(a, b) == m.bandwidth(a, b)
                assert back.rtt(a, b) == m.rtt(a, b)


def test_synthetic_models_are_seeded():
    assert synthetic_model(2, 3, seed=1).to_json() == synthetic_model(2, 3, seed=1).to_json()
    assert synthetic_model(2, 3, seed=1).to_json() != synthetic_model(2, 3, seed=2).to_json()


def _good() -> dict:
    return synthetic_model(2, 2, seed=0, measured_fraction=0.5).to_json()


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda d: d.update(format_version=99), "format_version"),
        (lambda d: d.pop("nodes"), "nodes"),
        (lambda d: d["nodes"][1].pop("region"), "nodes[1].region"),
        (lambda d: d["nodes"][2].update(uplink_bps="fast"), "nodes[2].uplink_bps"),
        (lambda d: d["nodes"][2].update(downlink_bps=0), "nodes[2].downlink_bps"),
        (lambda d: d["nodes"][1].update(role="boss"), "nodes[1].role"),
        (lambda d: d["nodes"][0].update(role="rollout"), "nodes"),
        (lambda d: d["nodes"][2].update(id=d["nodes"][1]["id"]), "nodes[2].id"),
        (lambda d: d["links"][0].update(src="ghost"), "links[0].src"),
        (lambda d: d["links"][0].update(bandwidth_bps=-1), "links[0].bandwidth_bps"),
        (lambda d: d["region_links"][0].update(rtt_s=None), "region_links[0].rtt_s"),
        (lambda d: d["regions"][0].update(intra_bandwidth_bps=0), "regions[0].intra_bandwidth_bps"),
    ],
)
def test_bad_model_json_names_the_field(mutate, field):
    data = _good()
    mutate(data)
    with pytest.raises(ValueError) as err:
        NetworkModel.from_json(data)
    assert str(err.value).startswith(field + ":"), str(err.value)
    assert isinstance(err.value, ModelError) and err.value.field == field


def test_a_file_that_is_not_json_is_a_value_error(tmp_path):
    path = tmp_path / "m.json"
    path.write_text("{nodes: ")
    with pytest.raises(ValueError, match="not valid JSON"):
        NetworkModel.load(path)
    path.write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="JSON object"):
        NetworkModel.load(path)


def test_measurements_become_a_model_with_region_medians():
    nodes = [NodeSpec("T", "A", "trainer", G, 10 * G), NodeSpec("a", "A", "rollout", 10 * G, 10 * G),
             NodeSpec("b", "B", "rollout", 10 * G, 10 * G), NodeSpec("c", "B", "rollout", 10 * G, 10 * G)]
    ms = [Measurement("a", "b", 0.4 * G, 0.05), Measurement("a", "c", 0.6 * G, 0.07), Measurement("T", "a", 0.9 * G, 0.001),
          Measurement("b", "c", 8 * G, 0.001)]
    m = model_from_measurements(nodes, ms)
    assert m.bandwidth("a", "b") == 0.4 * G  # measured
    assert m.bandwidth("T", "b") == pytest.approx(0.5 * G)  # median of A -> B, capped by T's 1G uplink
    assert m.rtt("T", "c") == pytest.approx(0.06)
    assert m.bandwidth("c", "b") == 8 * G  # B's intra median
    with pytest.raises(ValueError, match=r"measurements\[0\].src"):
        model_from_measurements(nodes, [Measurement("zz", "a", G, 0.1)])


def test_membership_changes_give_new_models():
    m = synthetic_model(2, 3, seed=0, measured_fraction=1.0)
    gone = m.node_ids[2]
    less = m.without_nodes([gone])
    assert gone not in less and gone in m
    assert all(gone not in (x.src, x.dst) for x in less.measurements())
    more = less.with_nodes([NodeSpec("new", "r01", "rollout", G, G)])
    assert "new" in more and len(more) == len(m)
    with pytest.raises(ValueError):
        m.without_nodes(["trainer"])
