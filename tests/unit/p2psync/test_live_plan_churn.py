"""The live plan under churn is the same plan, change after change, as the re-planner has always made.

The incremental path (:class:`topology.incremental.Replanner` under
:class:`p2psync.control.live_plan.LivePlanner`) keeps its state in place and hands out each plan
without walking every member (told which members changed, by PlanStep); this pins its output on a seeded churn sequence (joins, leaves and
both in one update, a relay among the leavers) to digests of the plans it produced before that
work: any change to a parent, fallback, share, estimate, epoch or the members named as moved fails it.
"""

from __future__ import annotations

import hashlib
import random

from p2psync.control.live_plan import LivePlanner, PlanMember
from topology.tree import Plan


def _digest(p: Plan) -> str:
    h = hashlib.sha256()
    h.update(f"{p.epoch}|{p.root}|{p.est_completion_s!r}".encode())
    for n in sorted(p.parents):
        h.update(f"{n}>{p.parents[n]}|{p.edge_bps[n]!r}|{p.eta_s[n]!r}|{','.join(p.fallbacks.get(n, []))}|"
                 f"{p.regions.get(n)}|{p.roles.get(n)}\n".encode())
    return h.hexdigest()[:16]


def _member(i: int) -> PlanMember:
    role = "trainer" if i == 0 else ("relay" if i % 16 == 0 else "rollout")
    return PlanMember(f"n{i:05d}", role, f"r{i % 6:02d}", 0.0 if i % 7 else 1.25e8)


def _churn(hint: bool = False) -> list[tuple[str, int, str]]:
    """(digest, epoch, last_moved) after each update of a seeded churn sequence on 1,500 members;
    ``hint``: each update is told which members changed (as PlanStep tells it)."""
    rng = random.Random(7)
    members = {m.id: m for m in map(_member, range(1500))}
    lp = LivePlanner("n00000")
    assert lp.update(list(members.values())) is not None
    out = []
    nxt = 1500
    for step in range(24):
        was = dict(members)
        for _ in range(rng.randrange(0, 6)):  # leaves (a relay now and then)
            pick = rng.choice(sorted(set(members) - {"n00000"}))
            del members[pick]
        for _ in range(rng.randrange(0 if step % 3 else 1, 6)):  # joins
            m = _member(nxt)
            nxt += 1
            members[m.id] = m
        if step % 5 == 4:  # a member comes back in another region: it leaves and joins in one update
            pick = rng.choice(sorted(set(members) - {"n00000"}))
            old = members[pick]
            members[pick] = PlanMember(pick, old.role, "r05" if old.region != "r05" else "r00", old.bandwidth)
        changed = {n: members.get(n) for n in {*was, *members} if was.get(n) is not members.get(n)}
        new = lp.update(list(members.values()), None, changed if hint else None)
        if new is None:
            continue
        moved = hashlib.sha256(",".join(sorted(lp.last_moved)).encode()).hexdigest()[:8]
        out.append((_digest(new), new.epoch, moved))
    return out


EXPECTED: list[tuple[str, int, str]] = [
    ('154ba17e021076d8', 2, 'e3b0c442'),
    ('8527fb8cecc504b0', 3, 'e3b0c442'),
    ('bca9e69d010b6606', 4, 'e3b0c442'),
    ('19a7cfb552b036d8', 6, '5ada326d'),
    ('bdea034c584eaeab', 8, '7f4c2c1a'),
    ('ebc38ec13808f799', 10, '5e1f2f62'),
    ('e6d34472664169ed', 12, 'f6521b50'),
    ('31b363164f8c420f', 13, 'e3b0c442'),
    ('21adba0bab3fb686', 14, 'e3b0c442'),
    ('c7152d42a1d80232', 16, '8b0a266e'),
    ('a9dfb6fb2f318958', 18, '9e4d1e22'),
    ('92ac6f57f3c13f5d', 20, 'e3b0c442'),
    ('2eadb30a0a19ebee', 22, 'e3b0c442'),
    ('3780f16d87b55d65', 24, '04beba6d'),
    ('3af90decd108337f', 26, 'e9cb828f'),
    ('6446bf4239c6df8d', 28, 'ce5a4af9'),
    ('7c4f75e63fde603c', 29, 'e3b0c442'),
    ('cbc13b732b25d5ee', 31, '72600a04'),
    ('e92be9b5c657a6ce', 33, '46fdaf7a'),
    ('f796794be3d3fff4', 35, '91ffa337'),
    ('17416a05309264eb', 36, 'e3b0c442'),
    ('f2801917efcca7b8', 37, 'e3b0c442'),
    ('79de24f3c4d38936', 39, '17822458'),
    ('6d98631a957714fa', 40, 'e3b0c442'),
]


def test_churn_sequence_plans_unchanged() -> None:
    assert _churn() == EXPECTED


def test_changed_members_hint_gives_the_same_plans() -> None:
    assert _churn(hint=True) == EXPECTED
