"""The incremental re-planner's repairs, pinned: a seeded sequence of failures (the busiest relay, a
region entry), batched leaves, joins and a partition on a model with measured links and relays gives
the plans it gave before its per-change work was made proportional to the part of the tree touched.
Any change to a parent, fallback, share, estimate, epoch or moved set fails it.
"""

from __future__ import annotations

import hashlib
import random

from topology.incremental import Change, Replanner
from topology.model import NodeSpec
from topology.planner import PlannerConfig, plan
from topology.synthetic import synthetic_model


def _digest(c: Change) -> str:
    p = c.plan
    h = hashlib.sha256()
    h.update(f"{p.epoch}|{p.root}|{p.est_completion_s!r}|{','.join(sorted(c.moved))}".encode())
    for n in sorted(p.parents):
        h.update(f"{n}>{p.parents[n]}|{p.edge_bps[n]!r}|{p.eta_s[n]!r}|{','.join(p.fallbacks.get(n, []))}\n".encode())
    return h.hexdigest()[:16]


def _sequence() -> list[str]:
    model = synthetic_model(6, 120, seed=5, relays_per_region=3, measured_fraction=0.05)
    rp = Replanner(plan(model, PlannerConfig()), model)
    rng = random.Random(11)
    out = []
    for step in range(12):
        p = rp.model
        ids = sorted(n for n in p.node_ids if n != p.trainer)
        children: dict[str, int] = {}
        for c, x in rp.parents.items():
            children[x] = children.get(x, 0) + 1
        if step % 4 == 0:
            busiest = max(ids, key=lambda n: (children.get(n, 0), n))
            c = rp.fail(busiest)
        elif step % 4 == 1:
            c = rp.leave(rng.sample(ids, 7))
        elif step % 4 == 2:
            region = rng.choice(p.region_names())
            c = rp.join_many([NodeSpec(f"j{step}-{k}", region if k % 2 else rng.choice(p.region_names()), "rollout",
                                       uplink_bps=rng.choice((1e9, 1e10)), downlink_bps=1e10) for k in range(6)])
        else:
            entry = next(x for x, y in sorted(rp.parents.items()) if rp.regions[x] != rp.regions[y])
            c = rp.fail(entry)
        out.append(_digest(c))
    c = rp.partition("r03")
    out.append(_digest(c))
    return out


EXPECTED = [
    'a7779c37e8362e3a',
    'e7a24da6e97940c7',
    '6cade95e2df590bc',
    'd65d9ff36ec7bf61',
    'fdd59ca22c99a7f9',
    'c7299c204259faf7',
    '519936e4cc8ff1c1',
    '23c93f41f3a1cfa5',
    'f144b945511e163f',
    '03cbac84eaf58b66',
    '915ce776d7f70405',
    'eb05717c9fe0d254',
    '7430e2fe046adb47',
]


def test_repairs_are_the_pinned_plans() -> None:
    assert _sequence() == EXPECTED
