"""How a node orders its own decode against receiving and forwarding (:mod:`p2psync.node.priority`):
a pure function of the usable cores, the children following the node and the load average."""

from __future__ import annotations

import pytest

from p2psync.node.priority import DECODE_NICE, choose


def test_a_node_with_children_forwards_first_on_any_machine():
    for cores, load in ((2, 17.0), (2, 0.0), (16, 0.5), (64, 3.0)):
        o = choose(cores, 3, load, 6)
        assert o.forward_first and o.nice == DECODE_NICE, (cores, load, o)


def test_a_leaf_with_spare_cores_decodes_as_chunks_arrive_on_the_idle_cores():
    o = choose(16, 0, 1.0, 6)
    assert not o.forward_first and o.nice == DECODE_NICE and o.threads == 6
    o = choose(2, 0, 0.2, 6)
    assert not o.forward_first and o.threads == 2


def test_without_a_spare_core_a_leaf_holds_first_and_decodes_on_one_thread():
    # 17 node processes on two shared cores: decoding while receiving cannot overlap onto an idle core.
    o = choose(2, 0, 17.0, 6)
    assert o.forward_first and o.threads == 1 and o.nice == DECODE_NICE
    assert choose(2, 0, 1.2, 6).forward_first  # 0.8 of a core free: no whole core to overlap onto


def test_decode_threads_follow_the_cores_the_load_leaves_free_within_the_pool():
    assert [choose(16, 0, load, 6).threads for load in (0.0, 10.4, 12.6, 14.0, 15.5, 40.0)] == [6, 6, 3, 2, 1, 1]
    assert choose(8, 2, 0.0, 4).threads == 4


@pytest.mark.parametrize("load", [float("nan"), float("inf"), -1.0])
def test_an_unreadable_load_counts_as_busy_not_idle(load):
    o = choose(4, 0, load, 6)
    assert o.threads >= 1
    if load != -1.0:
        assert o.forward_first and o.threads == 1


def test_settings_given_are_kept_as_given():
    o = choose(2, 5, 17.0, 6, forward_first=False, nice=0, threads=4)
    assert (o.forward_first, o.nice, o.threads) == (False, 0, 4)
    o = choose(64, 0, 0.0, 6, forward_first=True)
    assert o.forward_first and o.threads == 6


def test_the_reason_names_what_the_choice_was_made_from():
    why = choose(2, 1, 17.3, 6).why
    assert "2 cores" in why and "load 17.3" in why and "1 child" in why and "forward first" in why
