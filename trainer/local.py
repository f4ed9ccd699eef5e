"""In-process rollouts: a :class:`~p2psync.control.api.WorkSink` that generates beside the trainer.

For single-machine runs without rollout nodes, and for the trainer's own tests
and benchmarks. It generates with a copy of the policy in the rollout dtype whose
weights are taken bit for bit from the trainer node's applied state (the very
bits the published artifacts produce), honours ``min_version`` by waiting for
the node to reach it, and reports tempered float32 log-probabilities the way the
rollout engines do (:mod:`rollout.engines.base`). The real distributed path is the
trainer node's coordinator; this one exists so a GRPO run can be exercised and
measured without a cluster.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import AsyncIterator
from typing import Any

import torch

from p2psync.control.api import Result, ResponseResult, RolloutRequest

logger = logging.getLogger(__name__)


@torch.no_grad()
def sample(model: torch.nn.Module, prompt: list[int], n: int, req: RolloutRequest,
           generator: torch.Generator) -> list[tuple[list[int], list[float], str]]:
    """``n`` responses to one prompt: (tokens incl. a final stop token, tempered log-probs, finish reason)."""
    ids = torch.tensor([prompt] * n, dtype=torch.long)
    out = model(input_ids=ids, use_cache=True)
    past, logits = out.past_key_values, out.logits[:, -1].float()
    stop = torch.tensor(sorted(set(req.stop_token_ids)) or [-1])
    tokens: list[list[int]] = [[] for _ in range(n)]
    lps: list[list[float]] = [[] for _ in range(n)]
    done = torch.zeros(n, dtype=torch.bool)
    reasons = ["length"] * n
    t = req.temperature if req.temperature > 0 else 1.0
    for _ in range(req.max_new_tokens):
        logp = torch.log_softmax(logits / t, dim=-1)
        if req.temperature > 0:
            tok = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
        else:
            tok = logp.argmax(-1)
        lp = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
        for i in range(n):
            if not done[i]:
                tokens[i].append(int(tok[i]))
                lps[i].append(float(lp[i]))
        hit = torch.isin(tok, stop) & ~done
        for i in hit.nonzero().flatten().tolist():
            reasons[i] = "stop"
        done |= hit
        if bool(done.all()):
            break
        out = model(input_ids=tok.unsqueeze(-1), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1].float()
    return [(tokens[i], lps[i], reasons[i]) for i in range(n)]


class InProcessRollouts:
    """A WorkSink generating in this process from ``node``'s applied weights. Start with :meth:`start`."""

    def __init__(self, node: Any, model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> None:
        self.node = node
        self.policy = copy.deepcopy(model).to(dtype).eval()
        self.version: int | None = None
        self._queue: asyncio.Queue[tuple[str, dict, int]] = asyncio.Queue()
        self._results: asyncio.Queue[Result] = asyncio.Queue()
        self._seen: set[str] = set()
        self._pending = 0
        self._gen = torch.Generator().manual_seed(seed)
        self._task: asyncio.Task | None = None

    def start(self) -> InProcessRollouts:
        self._task = asyncio.create_task(self._serve(), name="in-process-rollouts")
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    # --- WorkSink ------------------------------------------------------------------------------
    def submit(self, work_id: str, payload: dict[str, Any], *, prompt_key: str = "", responses: int = 1) -> None:
        if work_id in self._seen:
            return
        self._seen.add(work_id)
        self._pending += 1
        self._queue.put_nowait((work_id, payload, responses))

    async def results(self) -> AsyncIterator[Result]:
        while True:
            yield await self._results.get()

    def pending(self) -> int:
        return self._pending

    # --- generation ----------------------------------------------------------------------------
    def _load(self) -> bool:
        """Copy the node's applied weights bit for bit; True if the copy audits to the node's fingerprint.

        The node applies the next version in place from a worker thread, so a copy taken
        meanwhile can be torn: the audit catches that and the caller copies again.
        """
        from p2psync.checkpoint_names import checkpoint_tensors
        from p2psync.state import ModelState

        state, version, fingerprint = self.node.state, self.node.version, self.node.fingerprint
        params = checkpoint_tensors(self.policy)  # views of the policy's memory, under the table's names
        with torch.no_grad():
            for name in state:
                params[name].copy_(state.tensor(name))
        if ModelState((name, params[name]) for name in state).audit() != fingerprint:
            return False
        self.version = version
        return True

    async def _serve(self) -> None:
        while True:
            work_id, payload, n = await self._queue.get()
            req = RolloutRequest.from_json(payload)
            await self.node.wait_version(req.min_version)
            while self.version != self.node.version and not await asyncio.to_thread(self._load):
                await asyncio.sleep(0.01)
            version = self.version
            assert version is not None  # the node holds req.min_version or newer, and so do we
            out = await asyncio.to_thread(sample, self.policy, req.prompt_ids, n, req, self._gen)
            responses = [ResponseResult(toks, lps, [version] * len(toks), reason) for toks, lps, reason in out]
            self._pending -= 1
            await self._results.put(Result(work_id, "local", payload, responses, False))
