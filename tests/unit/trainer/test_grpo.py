"""GRPO: advantages and the clipped off-policy loss against hand-computed values; tasks; a short run that learns."""

from __future__ import annotations

import asyncio
import json
import math
import random

import pytest
import torch

from p2psync import config, keys
from p2psync.control.api import Result, ResponseResult, RolloutRequest
from p2psync.errors import ConfigError
from p2psync.node import Node
from p2psync.state import ModelState
from trainer.grpo import GRPOOptions, GRPORun
from trainer.grpo_math import group_advantages, grpo_loss, response_logprobs
from trainer.tasks import CharTokenizer, Problem, make_task


# --- math ---------------------------------------------------------------------------------------
def test_group_advantages_by_hand():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    s = math.sqrt(1 / 3)  # unbiased std of {1, 0, 0, 1}
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, -0.5, 0.5]) / (s + 1e-6))
    assert torch.equal(group_advantages([1.0, 0.0, 0.0, 1.0], scale=False), torch.tensor([0.5, -0.5, -0.5, 0.5]))
    assert torch.equal(group_advantages([0.3, 0.3, 0.3]), torch.zeros(3))  # no signal, no NaN
    assert torch.equal(group_advantages([0.7]), torch.zeros(1))


def _lp(p: float) -> float:
    return math.log(p)


def test_clipped_ratio_with_stale_behaviour_logprobs_by_hand():
    # Four one-token responses. Behaviour log-probs come from an older version: ratios 2 and 0.5.
    logp = torch.tensor([[_lp(0.5)], [_lp(0.5)], [_lp(0.25)], [_lp(0.25)]], requires_grad=True)
    old = torch.tensor([[_lp(0.25)], [_lp(0.25)], [_lp(0.5)], [_lp(0.5)]])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    mask = torch.ones(4, 1)
    loss, st = grpo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # ratio 2,  A=+1: min(2, 1.28) = 1.28 (clipped)   -> -1.28
    # ratio 2,  A=-1: min(-2, -1.28) = -2             -> +2
    # ratio .5, A=+1: min(.5, .8) = .5                -> -0.5
    # ratio .5, A=-1: min(-.5, -.8) = -.8 (clipped)   -> +0.8
    assert loss.item() == pytest.approx((-1.28 + 2 - 0.5 + 0.8) / 4, abs=1e-6)
    assert st.clip_fraction == pytest.approx(0.5) and st.ratio_mean == pytest.approx((2 + 2 + 0.5 + 0.5) / 4)
    loss.backward()
    # Clipped tokens carry no gradient; the others d/dlogp (-ratio * A) / 4 = -ratio * A / 4.
    assert torch.allclose(logp.grad.flatten(), torch.tensor([0.0, 2 / 4, -0.5 / 4, 0.0]), atol=1e-6)


def test_token_vs_sequence_aggregation_and_kl_by_hand():
    logp = torch.zeros(2, 3)
    old = torch.zeros(2, 3)  # on-policy: ratio 1
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    tok, _ = grpo_loss(logp, old, adv, mask, aggregate="token")
    seq, _ = grpo_loss(logp, old, adv, mask, aggregate="sequence")
    assert tok.item() == pytest.approx((-1 * 3 + 2 * 1) / 4)
    assert seq.item() == pytest.approx((-1 + 2) / 2)
    ref = logp + math.log(2.0)  # reference twice as likely: k3 = 2 - ln 2 - 1
    with_kl, st = grpo_loss(logp, old, adv, mask, ref_logp=ref, beta=0.5)
    k3 = 2 - math.log(2.0) - 1
    assert st.kl == pytest.approx(k3) and with_kl.item() == pytest.approx(tok.item() + 0.5 * k3)
    with pytest.raises(ValueError):
        grpo_loss(logp, old, adv, mask, aggregate="mean")


def test_response_logprobs_are_the_tempered_next_token_logprobs():
    from p2psync.presets import build_model

    model = build_model("tiny", seed=1).eval()
    prompts, responses = [[1, 5, 6], [1, 7]], [[9, 10], [11, 12, 13]]
    with torch.no_grad():
        got, mask = response_logprobs(model, prompts, responses, temperature=0.7)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            logits = model(input_ids=torch.tensor([p + r])).logits[0].float()
            for j, tok in enumerate(r):
                want = torch.log_softmax(logits[len(p) - 1 + j] / 0.7, -1)[tok]
                assert got[i, j].item() == pytest.approx(want.item(), abs=1e-5)
    assert mask.tolist() == [[1, 1, 0], [1, 1, 1]]


# --- tokenizer and tasks ---------------------------------------------------------------------------
def test_tokenizer_every_id_decodes_and_stop_ids_cover_the_stop_symbol():
    tok = CharTokenizer(512)
    ids = tok.encode("3+4=")
    assert ids[0] == tok.bos_id and tok.decode(ids[1:] + [tok.eos_id]) == ("3+4=", True)
    k = len(tok.symbols)
    assert tok.decode([ids[1] + k, ids[1] + 5 * k]) == ("33", False)  # aliases of "3"
    assert all(tok.symbol(i) == "\x02" for i in tok.stop_ids) and tok.stop_ids[0] == tok.eos_id
    assert len(tok.stop_ids) == len(range(2, 512, k))
    with pytest.raises(ConfigError):
        CharTokenizer(8)
    with pytest.raises(ValueError):
        tok.encode("x")


def test_addition_rewards():
    task = make_task("add_small")
    p = Problem("3+4=", "7")
    assert task.reward(p, "7", True) == 1.0
    assert task.reward(p, "7", False) == pytest.approx(0.5)  # right number, never stopped
    assert task.reward(p, "6", True) == pytest.approx(0.5 * (1 - 1 / 4) + 0.1)
    assert task.reward(p, "6+", True) == pytest.approx(0.5 * (1 - 1 / 4))
    assert task.reward(p, "+", True) == 0.0 and task.reward(p, "", True) == 0.0
    rng = random.Random(0)
    for _ in range(50):
        q = task.sample(rng)
        a, b = q.prompt[:-1].split("+")
        assert int(a) + int(b) == int(q.answer) and 0 <= int(a) <= 4
    with pytest.raises(ConfigError) as err:
        make_task("poetry")
    assert err.value.field == "task"


def test_options_name_the_bad_field():
    with pytest.raises(ConfigError) as err:
        GRPOOptions.from_dict({"stpes": 3})
    assert err.value.field == "stpes"
    for bad, field in (({"lr": 0}, "lr"), ({"group_size": 0}, "group_size"), ({"rollouts": "x"}, "rollouts"),
                       ({"position_coding": "sorted"}, "position_coding")):
        with pytest.raises(ConfigError) as err:
            GRPOOptions.from_dict(bad)
        assert err.value.field == field
    assert GRPOOptions.from_dict({"position_coding": "base-free"}).position_coding == "base-free"


# --- runs on a real trainer node ---------------------------------------------------------------------
def _trainer_cfg(tmp_path):
    keys.write_pair(keys.generate(), tmp_path / "keys")
    return config.load(overrides={
        "id": "trainer", "role": "trainer", "data_dir": str(tmp_path / "t"), "cluster_token": "grpo-test-token",
        "trainer_public_key": str(tmp_path / "keys" / "trainer.pub"),
        "trainer_private_key": str(tmp_path / "keys" / "trainer.key"), "store": {"snapshot_interval": 0}})


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_short_run_improves_reward_and_logs_every_version(tmp_path):
    """30 steps of add_small on the tiny model with in-process rollouts from the node's published bits.

    On-policy (k = 0): every group is generated with the version the step trains, so the run does
    not depend on thread timing and the learning check is deterministic.
    """
    opts = GRPOOptions.from_dict({"steps": 30, "rollouts": "local", "threads": 1, "publish_threads": 1, "seed": 0,
                                  "max_staleness": 0,
                                  "metrics_path": str(tmp_path / "m.jsonl"),
                                  "versions_path": str(tmp_path / "v.jsonl")})

    async def go():
        node = await Node.create(_trainer_cfg(tmp_path))
        job = await GRPORun.create(node, opts)
        try:
            assert await job.train() == 0
            published = {n: t.detach().to(torch.bfloat16) for n, t in job.model.state_dict().items()
                         if n != "lm_head.weight"}  # tied to the embedding: published once
            assert node.version == 30 and node.fingerprint == ModelState(published).fingerprint
        finally:
            await job.close()
            await node.close()

    asyncio.run(go())
    rows = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 31)) and [r["version"] for r in rows] == list(range(1, 31))
    for r in rows:
        assert {"reward_mean", "reward_std", "changed_fraction", "payload_bytes", "full_bytes", "encode_s",
                "publish_s", "step_s", "fingerprint", "time"} <= set(r)
        assert 0 < r["payload_bytes"] < r["full_bytes"] and 0 < r["changed_fraction"] <= 1
        assert r["staleness_max"] == 0
    versions = [json.loads(x) for x in (tmp_path / "v.jsonl").read_text().splitlines()]
    assert [v["version"] for v in versions] == list(range(31))
    assert [v["fingerprint"] for v in versions[1:]] == [r["fingerprint"] for r in rows]
    first = sum(r["reward_mean"] for r in rows[:5]) / 5
    last = sum(r["reward_mean"] for r in rows[-5:]) / 5
    print(f"reward first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert last > first + 0.1, (first, last)


class _OldestAllowed:
    """A WorkSink whose rollouts always use the oldest weights a request allows (``min_version``)."""

    def __init__(self, vocab: int) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.rng = random.Random(1)
        self.vocab = vocab
        self.min_versions: list[int] = []

    def submit(self, work_id, payload, *, prompt_key="", responses=1):
        req = RolloutRequest.from_json(payload)
        self.min_versions.append(req.min_version)
        out = []
        for _ in range(responses):
            toks = [self.rng.randrange(self.vocab) for _ in range(2)] + [req.stop_token_ids[0]]
            out.append(ResponseResult(toks, [-math.log(self.vocab)] * 3, [req.min_version] * 3, "stop"))
        self.queue.put_nowait(Result(work_id, "r", payload, out, False))

    async def results(self):
        while True:
            yield await self.queue.get()

    def pending(self):
        return self.queue.qsize()


@pytest.mark.parametrize("sync", [True, False])
def test_staleness_bound_holds_and_sync_off_keeps_version_zero(tmp_path, sync):
    opts = GRPOOptions.from_dict({"steps": 4, "groups_per_step": 2, "group_size": 2, "max_staleness": 1,
                                  "threads": 1, "publish_threads": 1, "sync": sync,
                                  "metrics_path": str(tmp_path / "m.jsonl")})

    async def go():
        node = await Node.create(_trainer_cfg(tmp_path))
        node.coordinator = _OldestAllowed(512)
        job = await GRPORun.create(node, opts)
        try:
            await job.train()
            return job, node.version
        finally:
            await job.close()
            await node.close()

    job, version = asyncio.run(go())
    rows = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    if sync:
        assert version == 4 and all(r["staleness_max"] <= 1 for r in rows)
        # Staleness-aware admission: a group with a step's worth of groups ahead of it asks for the
        # current version, so even a sink that always uses the oldest allowed weights never returns
        # one too old to train on (nothing generated in vain).
        assert job.dropped_stale == 0
        assert job.sink.min_versions[:4] == [0, 0, 0, 0] and job.sink.min_versions[4:] == [1, 1, 2, 2, 3, 3]
    else:
        assert version == 0 and {r["version"] for r in rows} == {0} and job.dropped_stale == 0
        assert set(job.sink.min_versions) == {0} and all(r["payload_bytes"] == 0 for r in rows)


def test_sync_full_publishes_every_step_as_a_full_weight_snapshot(tmp_path):
    """``sync: "full"`` is the full-weight baseline: same loop and staleness rule, each version a whole snapshot."""
    for bad in ("yes", "sparse", 1):
        with pytest.raises(ConfigError) as err:
            GRPOOptions.from_dict({"sync": bad})
        assert err.value.field == "sync"
    opts = GRPOOptions.from_dict({"steps": 3, "groups_per_step": 2, "group_size": 2, "max_staleness": 1,
                                  "threads": 1, "publish_threads": 1, "sync": "full", "lr": 1e-6,
                                  "metrics_path": str(tmp_path / "m.jsonl")})

    async def go():
        node = await Node.create(_trainer_cfg(tmp_path))
        node.coordinator = _OldestAllowed(512)
        job = await GRPORun.create(node, opts)
        try:
            await job.train()
            published = {n: t.detach().to(torch.bfloat16) for n, t in job.model.state_dict().items()
                         if n != "lm_head.weight"}
            assert node.version == 3 and node.fingerprint == ModelState(published).fingerprint
            return [r.kind for r in job.pub.records]
        finally:
            await job.close()
            await node.close()

    kinds = asyncio.run(go())
    assert kinds == ["snapshot"] * 4
    rows = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["changed_fraction"] == 1.0 and r["full_bytes"] <= r["payload_bytes"] <= 1.01 * r["full_bytes"]


class _LaggingSink(_OldestAllowed):
    """Its first ``lag`` results come from version 0 whatever the request allows (a node that fell behind)."""

    def __init__(self, vocab: int, lag: int) -> None:
        super().__init__(vocab)
        self.lag = lag

    def submit(self, work_id, payload, *, prompt_key="", responses=1):
        if self.lag > 0:
            self.lag -= 1
            req = RolloutRequest.from_json(payload)
            payload = RolloutRequest(req.prompt_ids, req.max_new_tokens, temperature=req.temperature,
                                     stop_token_ids=req.stop_token_ids, min_version=0, seed=req.seed).to_json()
            self.min_versions.append(-1)
            out = [ResponseResult([req.stop_token_ids[0]], [-1.0], [0], "stop") for _ in range(responses)]
            self.queue.put_nowait(Result(work_id, "r", payload, out, False))
            return
        super().submit(work_id, payload, prompt_key=prompt_key, responses=responses)


def test_results_older_than_the_bound_are_dropped_and_asked_again(tmp_path):
    opts = GRPOOptions.from_dict({"steps": 4, "groups_per_step": 2, "group_size": 2, "max_staleness": 1,
                                  "threads": 1, "publish_threads": 1, "metrics_path": str(tmp_path / "m.jsonl")})

    async def go():
        node = await Node.create(_trainer_cfg(tmp_path))
        node.coordinator = _LaggingSink(512, lag=6)
        job = await GRPORun.create(node, opts)
        try:
            await job.train()
            return job
        finally:
            await job.close()
            await node.close()

    job = asyncio.run(go())
    rows = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["staleness_max"] <= 1 for r in rows)
    assert job.dropped_stale > 0 and rows[-1]["dropped_stale"] == job.dropped_stale
