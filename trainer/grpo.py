"""A reference GRPO trainer on the trainer node: ``p2psync node --role trainer --job trainer.grpo:run``.

Loop. Prompt groups go to the node's coordinator (``node.coordinator``, a
:class:`~p2psync.control.api.WorkSink`) as :class:`~p2psync.control.api.RolloutRequest`
payloads with ``min_version = version - max_staleness``. Results are consumed as
they stream in; as soon as ``groups_per_step`` groups are complete a step starts:
group-relative advantages, the clipped importance ratio against the behaviour
log-probabilities the rollout engine reported (samples may be up to
``max_staleness`` versions old; older ones are dropped and their prompt asked
again), optional KL to the initial weights, AdamW on fp32 master weights. After
the step the :class:`~trainer.publisher.Publisher` extracts the change and
publishes it in the background while the next step's groups are collected.

Metrics (``metrics_path``): one JSON line per step, written once that step's
version is published: ``step, version, reward_mean, reward_std, changed_fraction,
payload_bytes, full_bytes, encode_s, publish_s, step_s, fingerprint, time`` plus
loss statistics. ``versions_path`` (optional): one line per published version
(``version, fingerprint, time``), version 0 included.

Warm start (``warm_start_steps > 0``): before version 0 is published, that many
supervised steps on the task's answers and, weighted ``warm_start_noise``, its near
misses (:meth:`trainer.tasks.Task.near_miss`), with their own AdamW; version 0 is
the warmed model, so every rollout node starts from it. A ``{"event": "warm_start",
...}`` line goes to ``metrics_path``.

``sync: false`` publishes version 0 only: rollouts keep generating with it (the
staleness bound is then not enforced), to measure step time without weight sync.
``sync: "full"`` publishes every version as a full snapshot of the weights (the
full-weight broadcast users run today) instead of a sparse delta, for comparison.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from p2psync.codec.encode import position_buckets
from p2psync.control.api import Result, RolloutRequest
from p2psync.errors import ConfigError
from trainer.grpo_math import LossStats, group_advantages, grpo_loss, response_logprobs
from trainer.tasks import CharTokenizer, Problem, Task, make_task

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GRPOOptions:
    """The job config (``--job-config``), validated; unknown keys are an error."""

    preset: str = "tiny"
    """Model preset of :data:`p2psync.presets.PRESETS` (random init); the rollout nodes must use the same.
    ``tiny`` learns ``add_small`` visibly within a minute on 2 CPU cores; ``small`` does not within minutes."""
    model_path: str | None = None
    """A local Hugging Face folder to load instead of a preset."""
    task: str = "add_small"
    """One of :data:`trainer.tasks.TASKS`."""
    steps: int = 30
    group_size: int = 8
    """Responses per prompt."""
    groups_per_step: int = 8
    lr: float = 1e-2
    """High for RL, on purpose: a random-init model must learn within minutes (most bf16 weights then
    change every step; at RL fine-tuning rates of 1e-6..1e-5 only ~1 % do)."""
    max_staleness: int = 1
    """k: a sample generated with weights more than k versions older than the step's is dropped."""
    temperature: float = 1.0
    reward: str = "shaped"
    """``"shaped"``: the task's reward (partial credit for near answers); ``"exact"``: 1 for the exact
    answer followed by the stop symbol, else 0 (a verifiable reward, as RL on reasoning uses)."""
    adam_eps: float = 1e-8
    """AdamW's epsilon (RL recipes such as PPO's often take 1e-5)."""
    clip_low: float = 0.2
    clip_high: float = 0.28
    beta: float = 0.0
    """KL weight to the initial weights (0: no reference model)."""
    scale_advantages: bool = True
    aggregate: str = "token"
    """``"token"`` or ``"sequence"`` loss aggregation."""
    max_grad_norm: float = 1.0
    seed: int = 0
    sync: bool | str = True
    """True: publish every step as a sparse delta; False: publish version 0 only (measures the step time
    without weight sync); ``"full"``: publish every step as a full-weight snapshot (the baseline)."""
    rollouts: str = "node"
    """``"node"``: the node's coordinator; ``"local"``: generate in this process (no rollout nodes)."""
    threads: int = 0
    """torch threads for training (0: leave torch's default)."""
    publish_threads: int = 2
    """Codec threads of the publisher."""
    chunk_size: int = 1 << 20
    position_coding: str = "ranked"
    """How deltas code their positions (:class:`trainer.publisher.Publisher`): ``"ranked"`` or ``"base-free"``."""
    publish_first: bool | None = None
    """Announce each version before the next step's training starts (None: when ``max_staleness <= 1``).
    At k <= 1 the next-but-one batch waits for this version on the rollout nodes, while the next
    step's training is not on that path; running both at once only slows the announcement."""
    warm_start_steps: int = 0
    """Supervised steps on the task before version 0 is published (0: RL from the initial weights)."""
    warm_start_lr: float = 1e-3
    warm_start_batch: int = 32
    """Demonstrations per warm-start step."""
    warm_start_noise: float = 0.0
    """Weight of each problem's near miss (:meth:`trainer.tasks.Task.near_miss`) in the warm start;
    the answer has ``1 - warm_start_noise``. 0.5: the warmed policy hesitates between the two."""
    warm_start_threads: int = 0
    """torch threads for the warm start (0: as ``threads``); nothing else runs on the cores meanwhile."""
    metrics_path: str | None = None
    versions_path: str | None = None

    def __post_init__(self) -> None:
        for name in ("steps", "group_size", "groups_per_step", "publish_threads"):
            if getattr(self, name) < 1:
                raise ConfigError(name, "must be >= 1")
        if self.max_staleness < 0 or self.threads < 0:
            raise ConfigError("max_staleness" if self.max_staleness < 0 else "threads", "must be >= 0")
        if not self.lr > 0:
            raise ConfigError("lr", "must be > 0")
        if self.warm_start_steps < 0 or self.warm_start_threads < 0 or self.warm_start_batch < 1:
            raise ConfigError("warm_start_steps" if self.warm_start_steps < 0 else "warm_start_threads"
                              if self.warm_start_threads < 0 else "warm_start_batch", "out of range")
        position_buckets(self.position_coding)  # a name the publisher knows, checked at start
        if not self.warm_start_lr > 0:
            raise ConfigError("warm_start_lr", "must be > 0")
        if not 0.0 <= self.warm_start_noise < 1.0:
            raise ConfigError("warm_start_noise", f"must be in [0, 1), got {self.warm_start_noise!r}")
        if self.reward not in ("shaped", "exact"):
            raise ConfigError("reward", f"must be 'shaped' or 'exact', got {self.reward!r}")
        if not self.adam_eps > 0:
            raise ConfigError("adam_eps", "must be > 0")
        if self.aggregate not in ("token", "sequence"):
            raise ConfigError("aggregate", f"must be 'token' or 'sequence', got {self.aggregate!r}")
        if self.rollouts not in ("node", "local"):
            raise ConfigError("rollouts", f"must be 'node' or 'local', got {self.rollouts!r}")
        if not isinstance(self.sync, bool) and self.sync != "full":
            raise ConfigError("sync", f"must be true, false or 'full', got {self.sync!r}")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0 and self.beta >= 0):
            raise ConfigError("clip_low", "need 0 <= clip_low < 1, clip_high >= 0, beta >= 0")

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> GRPOOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(unknown[0], f"unknown GRPO option (known: {', '.join(sorted(known))})")
        return cls(**options)


@dataclass
class Group:
    """A finished prompt group with its rewards."""

    work_id: str
    problem: Problem
    prompt_ids: list[int]
    result: Result
    rewards: list[float]
    temperature: float


@dataclass
class StepStats:
    reward_mean: float
    reward_std: float
    accuracy: float
    """Share of responses with the full reward."""
    loss: LossStats
    step_s: float
    staleness_max: int


class GRPOTrainer:
    """One GRPO step at a time on a batch of groups (sync, CPU/GPU heavy: run it in a thread)."""

    def __init__(self, model: torch.nn.Module, opts: GRPOOptions, tokenizer: CharTokenizer) -> None:
        self.model = model
        self.opts = opts
        self.tok = tokenizer
        self.opt = torch.optim.AdamW(model.parameters(), lr=opts.lr, betas=(0.9, 0.99), eps=opts.adam_eps,
                                     weight_decay=0.0)
        self.ref: torch.nn.Module | None = None
        if opts.beta > 0:
            import copy

            self.ref = copy.deepcopy(model).eval()
            for p in self.ref.parameters():
                p.requires_grad_(False)

    def step(self, groups: list[Group], version: int) -> StepStats:
        t0 = time.perf_counter()
        prompts, responses, olds, advs, staleness = [], [], [], [], 0
        rewards: list[float] = []
        for g in groups:
            adv = group_advantages(g.rewards, scale=self.opts.scale_advantages)
            for i, r in enumerate(g.result.responses):
                prompts.append(g.prompt_ids)
                responses.append(r.tokens)
                olds.append(r.logprobs)
                advs.append(float(adv[i]))
                if r.versions:
                    staleness = max(staleness, version - min(r.versions))
            rewards.extend(g.rewards)
        temperature = groups[0].temperature
        self.model.train()
        logp, mask = response_logprobs(self.model, prompts, responses, temperature, self.tok.pad_id)
        old = torch.zeros_like(logp)
        for i, lp in enumerate(olds):
            old[i, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
        ref = None
        if self.ref is not None:
            with torch.no_grad():
                ref, _ = response_logprobs(self.ref, prompts, responses, temperature, self.tok.pad_id)
        loss, stats = grpo_loss(logp, old, torch.tensor(advs), mask, clip_low=self.opts.clip_low,
                                clip_high=self.opts.clip_high, ref_logp=ref, beta=self.opts.beta,
                                aggregate=self.opts.aggregate)
        loss.backward()
        if self.opts.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.opts.max_grad_norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        rt = torch.tensor(rewards)
        return StepStats(float(rt.mean()), float(rt.std()) if rt.numel() > 1 else 0.0, float((rt >= 1.0).float().mean()),
                         stats, time.perf_counter() - t0, staleness)


@dataclass
class WarmStart:
    steps: int
    loss_first: float
    loss_last: float
    seconds: float


def warm_start(model: torch.nn.Module, task: Task, tok: CharTokenizer, opts: GRPOOptions) -> WarmStart:
    """Supervised steps on ``task``'s demonstrations (cross-entropy on the response and its stop symbol)."""
    t0 = time.perf_counter()
    before = torch.get_num_threads()
    if opts.warm_start_threads:  # set in the thread that computes (OpenMP's setting is per thread)
        torch.set_num_threads(opts.warm_start_threads)
    try:
        return _warm_steps(model, task, tok, opts, t0)
    finally:
        torch.set_num_threads(before)


def _warm_steps(model: torch.nn.Module, task: Task, tok: CharTokenizer, opts: GRPOOptions, t0: float) -> WarmStart:
    rng = random.Random(opts.seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=opts.warm_start_lr, betas=(0.9, 0.99), weight_decay=0.0)
    model.train()
    losses = []
    noise = opts.warm_start_noise
    for _ in range(opts.warm_start_steps):
        # Each problem with its answer (weight 1 - noise) and, when noise > 0, its near miss
        # (weight noise): the imitated mix is exact in every batch, not a sampled one.
        rows: list[tuple[list[int], list[int], float]] = []
        for _ in range(opts.warm_start_batch):
            problem = task.sample(rng)
            prompt = tok.encode(problem.prompt)
            rows.append((prompt, tok.encode(problem.answer, bos=False) + [tok.eos_id], 1.0 - noise))
            if noise > 0:
                rows.append((prompt, tok.encode(task.near_miss(problem), bos=False) + [tok.eos_id], noise))
        width = max(len(p) + len(r) for p, r, _ in rows)
        ids = torch.full((len(rows), width), tok.pad_id, dtype=torch.long)
        targets = torch.zeros((len(rows), width), dtype=torch.long)
        weight = torch.zeros((len(rows), width))
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (p, r, w) in enumerate(rows):
            ids[i, : len(p) + len(r)] = torch.tensor(p + r)
            attn[i, : len(p) + len(r)] = 1
            targets[i, len(p) - 1: len(p) - 1 + len(r)] = torch.tensor(r)  # logits at t predict token t + 1
            weight[i, len(p) - 1: len(p) - 1 + len(r)] = w
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits.float(), dim=-1)
        nll = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        loss = (nll * weight).sum() / weight.sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return WarmStart(len(losses), losses[0] if losses else math.nan, losses[-1] if losses else math.nan,
                     time.perf_counter() - t0)


class _Lines:
    """Append-only JSON-lines file, written from any thread."""

    def __init__(self, path: str | None) -> None:
        self.path = Path(path) if path else None
        self._lock = threading.Lock()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, row: dict[str, Any]) -> None:
        if self.path is None:
            return
        with self._lock, open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


class GRPORun:
    """The job: submit prompt groups, consume results, step, publish. Build with :meth:`create`."""

    def __init__(self, node: Any, opts: GRPOOptions) -> None:
        self.node = node
        self.opts = opts
        self.task: Task = make_task(opts.task)
        self.rng = random.Random(opts.seed)
        self.metrics = _Lines(opts.metrics_path)
        self.versions = _Lines(opts.versions_path)
        self.problems: dict[str, tuple[Problem, list[int]]] = {}
        self.history: list[dict[str, Any]] = []
        self._steps: dict[int, dict[str, Any]] = {}
        self._counter = 0
        self.dropped_stale = 0
        self.sink: Any = None
        self.local: Any = None
        self.pub: Any = None
        # Built by create():
        self.model: Any = None
        self.tok: CharTokenizer
        self.trainer: GRPOTrainer
        first = opts.publish_first
        self._publish_first = bool(opts.sync) and (opts.max_staleness <= 1 if first is None else first)

    @classmethod
    async def create(cls, node: Any, opts: GRPOOptions) -> GRPORun:
        from trainer.publisher import Publisher
        from p2psync.presets import build_model

        self = cls(node, opts)
        if opts.threads:
            torch.set_num_threads(opts.threads)
        self.model = await asyncio.to_thread(build_model, opts.preset, opts.model_path, opts.seed)
        self.tok = CharTokenizer(self.model.config.vocab_size)
        if opts.warm_start_steps:
            warm = await asyncio.to_thread(warm_start, self.model, self.task, self.tok, opts)
            logger.info("warm start: %d supervised steps, loss %.3f -> %.3f, %.1f s", warm.steps, warm.loss_first,
                        warm.loss_last, warm.seconds)
            self.metrics.write({"event": "warm_start", **vars(warm)})
        self.trainer = GRPOTrainer(self.model, opts, self.tok)
        await node.loaded.wait()
        model_id = opts.model_path or f"preset:{opts.preset}"
        self.pub = await Publisher.create(self.model, node, model_id=model_id, threads=opts.publish_threads,
                                          chunk_size=opts.chunk_size, on_record=self._on_record,
                                          full_weights=opts.sync == "full", position_coding=opts.position_coding,
                                          # extraction runs beside the next batch's forward/backward;
                                          # the optimizer's next step waits for it
                                          optimizer=self.trainer.opt)
        if opts.rollouts == "local":
            from trainer.local import InProcessRollouts

            self.local = InProcessRollouts(node, self.model, seed=opts.seed).start()
            self.sink = self.local
        else:
            sink = getattr(node, "coordinator", None)
            if sink is None:
                raise ConfigError("rollouts", "this node has no coordinator (control plane off?); "
                                              "use rollouts='local' to generate in-process")
            self.sink = sink
        return self

    # --- bookkeeping ----------------------------------------------------------------------------
    def _on_record(self, rec: Any) -> None:
        """Publisher thread: a version is published; write its step's metrics line."""
        # started: the optimizer step had ended and publish was called (the sync latency's start)
        self.versions.write({"version": rec.version, "fingerprint": rec.fingerprint, "time": rec.published_at,
                             "started": rec.published_at - rec.total_s})
        row = self._steps.pop(rec.version, None)
        if row is None:
            return
        row.update(changed_fraction=rec.changed_fraction, payload_bytes=rec.payload_bytes, full_bytes=rec.full_bytes,
                   encode_s=rec.extract_s + rec.encode_s, publish_s=rec.publish_s, fingerprint=rec.fingerprint,
                   time=time.time())
        self.history.append(row)
        self.metrics.write(row)

    def _submit(self, version: int) -> None:
        problem = self.task.sample(self.rng)
        prompt_ids = self.tok.encode(problem.prompt)
        self._counter += 1
        work_id = f"grpo-{self.opts.seed}-{self._counter}"
        # Staleness-aware admission: the groups already outstanding are consumed first, so this
        # one is trained on no earlier than ``ahead`` steps from now, when the trainer holds
        # version + ahead. Asking for at least version + ahead - k keeps it within the bound
        # then, instead of letting it start on older weights and be dropped as stale later.
        k = self.opts.max_staleness
        ahead = len(self.problems) // max(1, self.opts.groups_per_step)
        min_version = min(version, max(0, version + ahead - k)) if self.opts.sync else 0
        req = RolloutRequest(prompt_ids, self.task.max_new_tokens, temperature=self.opts.temperature,
                             stop_token_ids=self.tok.stop_ids, min_version=min_version,
                             seed=self.rng.randrange(1 << 31))
        self.problems[work_id] = (problem, prompt_ids)
        self.sink.submit(work_id, req.to_json(), prompt_key=problem.prompt, responses=self.opts.group_size)

    def _group(self, res: Result) -> Group | None:
        entry = self.problems.pop(res.work_id, None)
        if entry is None:
            logger.warning("result for unknown work %s ignored", res.work_id)
            return None
        problem, prompt_ids = entry
        rewards = []
        for r in res.responses:
            text, ended = self.tok.decode(r.tokens)
            reward = self.task.reward(problem, text, ended)
            rewards.append(float(reward >= 1.0) if self.opts.reward == "exact" else reward)
        return Group(res.work_id, problem, prompt_ids, res, rewards, self.opts.temperature)

    def _stale(self, res: Result, version: int) -> bool:
        if not self.opts.sync:
            return False
        oldest = min((min(r.versions) for r in res.responses if r.versions), default=version)
        return version - oldest > self.opts.max_staleness

    # --- the loop -------------------------------------------------------------------------------
    async def train(self) -> int:
        opts = self.opts
        version = self.pub.version
        in_flight = opts.groups_per_step * (1 + min(opts.max_staleness, 1))
        for _ in range(in_flight):
            self._submit(version)
        batch: list[Group] = []
        step = 0
        t_last = t_ready = time.perf_counter()
        handoff = 0.0
        async for res in self.sink.results():
            if self._stale(res, self.pub.version):
                self.dropped_stale += 1
                self.problems.pop(res.work_id, None)
                self._submit(self.pub.version)
                continue
            g = self._group(res)
            if g is None:
                continue
            batch.append(g)
            if len(batch) < opts.groups_per_step:
                continue
            groups, batch = batch[: opts.groups_per_step], batch[opts.groups_per_step:]
            step += 1
            waited = time.perf_counter() - t_ready
            stats = await asyncio.to_thread(self.trainer.step, groups, self.pub.version)
            row = {"step": step, "reward_mean": stats.reward_mean, "reward_std": stats.reward_std,
                   "accuracy": stats.accuracy, "loss": stats.loss.loss, "kl": stats.loss.kl,
                   "clip_fraction": stats.loss.clip_fraction, "ratio_mean": stats.loss.ratio_mean,
                   "staleness_max": stats.staleness_max, "dropped_stale": self.dropped_stale,
                   "train_s": stats.step_s, "wait_s": round(waited, 4), "handoff_s": round(handoff, 4)}
            now = time.perf_counter()
            row["step_s"] = now - t_last  # wall time per step: waiting for rollouts included
            t_last = now
            if opts.sync:
                version = await self.pub.publish()
                row["version"] = version
                self._steps[version] = row
                if self._publish_first:
                    await self.pub.flush()
            else:
                rec0 = self.pub.records[0] if self.pub.records else None
                row.update(version=self.pub.version, changed_fraction=0.0, payload_bytes=0,
                           full_bytes=rec0.full_bytes if rec0 else 0, encode_s=0.0, publish_s=0.0,
                           fingerprint=self.pub.fingerprints.get(self.pub.version), time=time.time())
                self.history.append(row)
                self.metrics.write(row)
            logger.info("step %d: reward %.3f (acc %.2f), version %s, %.2fs", step, stats.reward_mean,
                        stats.accuracy, row["version"], row["step_s"])
            if step >= opts.steps:
                break
            for _ in range(opts.groups_per_step):
                self._submit(self.pub.version)
            t_ready = time.perf_counter()
            handoff = t_ready - now  # publish (extraction, or a wait for a publish slot) and submitting
        await self.pub.flush()
        return 0

    async def close(self) -> None:
        if self.local is not None:
            await self.local.stop()
        if self.pub is not None:
            await self.pub.close()


async def run(node: Any, options: dict[str, Any]) -> int:
    """The node job: train ``steps`` GRPO steps and publish each; 0 on success."""
    opts = GRPOOptions.from_dict(dict(options))
    job = await GRPORun.create(node, opts)
    try:
        return await job.train()
    finally:
        await job.close()
