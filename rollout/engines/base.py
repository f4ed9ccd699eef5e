"""The rollout engine contract: requests and outputs, the sampling rule every engine follows, and the engine config.

A :class:`RolloutEngine` holds the policy's weights in the trainer's rollout
dtype and promises:

- **Bit-exact weights.** :attr:`RolloutEngine.state` is a
  :class:`~p2psync.state.ModelState` whose tensor table is the trainer's
  published table (HF state-dict names, tied weights held once) and whose words
  are the engine's own weights (for the transformers engine: the very memory of
  its parameters). :meth:`RolloutEngine.apply` applies a verified artifact to it
  all-or-nothing (:class:`p2psync.codec.decode.Applier`: wrong base, missing
  chunk or wrong resulting fingerprint raise and leave every weight untouched);
  :meth:`RolloutEngine.audit` recomputes the fingerprint from those weights.
- **Generation with log-probabilities**, batched and resumable: a
  :class:`SeqRequest` may carry ``prefix`` tokens generated earlier (by another
  holder of the lease); the engine continues after them and never regenerates
  them.
- **Safe points.** Generation advances one decode step per
  :meth:`Generation.step`; the caller (the worker) applies artifacts only
  between steps, never during one, so no token is computed from a half-applied
  state. An engine with ``switch_mid_generation = False`` (vLLM) is switched
  between batches only.

Log-probabilities (what GRPO's importance ratio is computed against)
---------------------------------------------------------------------
For a token sampled at temperature ``T > 0`` the reported log-probability is
``log_softmax(logits / T)[token]`` computed in float32 from the logits of the
weight version recorded for that token: the *tempered* distribution, *before*
top-p truncation (top-p only restricts which tokens may be drawn; the reported
value is not renormalised over the nucleus). With ``T <= 0`` (greedy) it is
``log_softmax(logits)[token]``. The trainer must recompute its log-probs the
same way (``log_softmax(logits / T)``) for the ratio to be 1 at equal weights.
(The vLLM engine reports vLLM's sampler's values instead; see :mod:`rollout.engines.vllm.engine`.)

Sampling is reproducible: the token at absolute response position ``i`` of a
stream with seed ``s`` is ``argmax(log p_T - log E)`` over the nucleus, with
``E ~ Exp(1)`` noise drawn from a generator seeded by ``(s, i)`` only (the
Gumbel-max trick vLLM uses too). So a response resumed from a prefix draws the
same noise as one generated without interruption; given equal logits it picks
the same tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import xxhash

from p2psync.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from p2psync.artifact import Manifest
    from p2psync.state import ModelState
    from p2psync.transport.leaf import Parent

_MASK63 = (1 << 63) - 1


# --- requests and outputs -------------------------------------------------------------------
@dataclass
class SeqRequest:
    """One response to generate (a prompt group of n responses is n of these)."""

    prompt_ids: list[int]
    max_new_tokens: int
    """Total response length cap, ``prefix`` included."""
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: Sequence[int] = ()
    seed: int = 0
    """Stream seed: with equal logits, equal seeds draw equal tokens (see module doc)."""
    prefix: list[int] = field(default_factory=list)
    """Tokens already generated for this response (by an earlier holder): continue after them."""
    min_version: int = 0
    key: Any = None
    """Caller's handle (the worker uses ``(work_id, response)``)."""

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt_ids: a request needs at least one prompt token")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")


@dataclass
class SeqState:
    """A response being generated: what it produced so far (``prefix`` not included)."""

    request: SeqRequest
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    """``"stop"`` (a stop token was drawn; it is the last token), ``"length"``, ``"cancelled"``; None while running."""

    @property
    def length(self) -> int:
        """Response tokens so far, prefix included."""
        return len(self.request.prefix) + len(self.tokens)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class TokenEvent:
    """One token produced by one :meth:`Generation.step`."""

    index: int
    """Index of the sequence in the generation."""
    token: int
    logprob: float
    version: int
    finished: str | None
    """The finish reason if this token ended the sequence."""


class Generation(ABC):
    """A batch in flight. Not thread-safe: one caller steps it, and nothing applies weights meanwhile."""

    seqs: list[SeqState]

    @abstractmethod
    def step(self) -> list[TokenEvent]:
        """Run one decode step (the first call also prefills) and return the new tokens."""

    def cancel(self, indices: Iterable[int]) -> None:
        """Stop generating for these sequences (their lease was lost)."""
        for i in indices:
            if not self.seqs[i].done:
                self.seqs[i].finish_reason = "cancelled"

    @property
    def done(self) -> bool:
        return all(s.done for s in self.seqs)


# --- the contract -----------------------------------------------------------------------------
@dataclass
class Prepared:
    """An artifact decoded against an engine's current weights, not yet written (:meth:`RolloutEngine.prepare`)."""

    manifest: Manifest
    applier: Any
    """The :class:`~p2psync.codec.decode.Applier` holding the decoded changes."""
    base_version: int | None
    """The engine version it was decoded against."""


class RolloutEngine(ABC):
    """Weights bit-equal to a published version, and generation from them (see module doc)."""

    name: str = "engine"
    switch_mid_generation: bool = True
    """Whether weights may change between two steps of one :class:`Generation`."""
    pulls_artifacts: bool = False
    """The engine fetches artifacts from a node's server itself (needs :meth:`attach` before :meth:`load`)."""

    version: int | None = None

    @property
    @abstractmethod
    def state(self) -> ModelState:
        """The engine's weights as a model state (checkpoint names, the trainer's table order)."""

    @property
    def fingerprint(self) -> str:
        """Incrementally maintained fingerprint of :attr:`state` (cheap)."""
        return self.state.fingerprint

    def audit(self, threads: int = 2) -> str:
        """The fingerprint recomputed from every word of the engine's weights."""
        return self.state.audit(threads)

    @abstractmethod
    def load(self, source: ModelState | None, version: int, expected_fingerprint: str | None = None) -> str:
        """Copy every weight from ``source`` (same tensor table), audit, and adopt ``version``.
        ``None``: an engine that pulls artifacts itself reaches ``version`` from its parent.

        Raises :class:`~p2psync.errors.FingerprintMismatch` (and keeps the old version number) if
        the copy does not hash to ``expected_fingerprint`` (e.g. ``source`` changed during the copy).
        """

    @abstractmethod
    def prepare(self, manifest: Manifest, chunks: Sequence[bytes], threads: int = 2) -> Prepared:
        """Check the base and decode an artifact against the current weights, writing nothing.

        Only reads the weights, so it may run while a generation step runs (another thread);
        the weights must not change between :meth:`prepare` and :meth:`commit`.
        """

    def prepare_decoded(self, manifest: Manifest, changes: dict, sums: list[tuple[int, int]]) -> Prepared:
        """Like :meth:`prepare` for a delta the node in this process already decoded
        (:meth:`p2psync.node.Node.decoded`): no second decode, only the base check."""
        from p2psync.codec.decode import Applier

        return Prepared(manifest, Applier.adopting(self.state, manifest, changes, sums), self.version)

    @abstractmethod
    def commit(self, prepared: Prepared) -> str:
        """Write a prepared artifact if its result hashes to the manifest's target (else nothing);
        returns the new fingerprint. A safe point: no generation step may run meanwhile."""

    def apply(self, manifest: Manifest, chunks: Sequence[bytes], threads: int = 2) -> str:
        """Apply a verified artifact all-or-nothing; returns the new fingerprint."""
        return self.commit(self.prepare(manifest, chunks, threads))

    @abstractmethod
    def start(self, requests: Sequence[SeqRequest]) -> Generation:
        """Begin generating ``requests`` as one batch with the current weights."""

    def generate(self, requests: Sequence[SeqRequest]) -> list[SeqState]:
        """Run a batch to the end (no weight changes meanwhile)."""
        gen = self.start(requests)
        while not gen.done:
            gen.step()
        return gen.seqs

    def attach(self, parent: Parent, version: int | None = None) -> None:
        """Tell an engine that pulls artifacts where from (default: nothing to do)."""  # noqa: B027 - optional hook

    def close(self) -> None:
        """Release engine resources (default: nothing to release)."""  # noqa: B027 - optional hook


# --- sampling ---------------------------------------------------------------------------------
def stream_seed(seed: int | None, *parts: int | str) -> int:
    """A 63-bit seed derived from ``seed`` and ``parts`` (stable across processes and runs)."""
    h = xxhash.xxh3_64(f"{seed}|{'|'.join(map(str, parts))}".encode()).intdigest()
    return h & _MASK63


def sample_rows(logits: torch.Tensor, seqs: Sequence[SeqRequest], positions: Sequence[int]
                ) -> tuple[list[int], list[float]]:
    """Draw one token per row of ``logits`` ([rows, vocab]) by the module's sampling rule.

    ``positions[r]`` is the absolute response position of the token drawn for row ``r``.
    Returns ``(tokens, logprobs)``.
    """
    import torch

    logits = logits.float()
    tokens: list[int] = []
    lps: list[float] = []
    for r, req in enumerate(seqs):
        row = logits[r]
        if req.temperature <= 0.0:
            lp = torch.log_softmax(row, dim=-1)
            tok = int(torch.argmax(row))
        else:
            lp = torch.log_softmax(row / req.temperature, dim=-1)
            scores = lp
            if req.top_p < 1.0:
                scores = _nucleus(lp, req.top_p)
            gen = torch.Generator().manual_seed(stream_seed(req.seed, positions[r]))
            noise = torch.empty_like(scores).exponential_(generator=gen)
            tok = int(torch.argmax(scores - noise.log()))
        tokens.append(tok)
        lps.append(float(lp[tok]))
    return tokens, lps


def _nucleus(lp: torch.Tensor, top_p: float) -> torch.Tensor:
    """``lp`` with every token outside the smallest set of mass >= ``top_p`` set to -inf."""
    import torch

    sorted_lp, idx = torch.sort(lp, descending=True)
    cum = torch.cumsum(sorted_lp.exp(), dim=-1)
    # Keep a token if the mass before it is below top_p (so the first token is always kept).
    drop_sorted = (cum - sorted_lp.exp()) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(0, idx, drop_sorted)
    return lp.masked_fill(drop, float("-inf"))


def finish_reason(req: SeqRequest, token: int, length: int) -> str | None:
    """Why a sequence ends after drawing ``token`` as response token number ``length`` (1-based)."""
    if token in req.stop_token_ids:
        return "stop"
    if length >= req.max_new_tokens:
        return "length"
    return None


# --- configuration ----------------------------------------------------------------
@dataclass(frozen=True)
class EngineConfig:
    """What model to build and how to run it (the same model options the trainer takes)."""

    engine: str = "hf"
    """A name of the registry :data:`rollout.engines.ENGINES` (``"hf"``: transformers, ``"vllm"``)."""
    preset: str = "small"
    """A preset of :data:`p2psync.presets.PRESETS` (used when neither ``model_path`` nor ``model_config``)."""
    model_path: str | None = None
    """A local Hugging Face folder: its config builds the model (weights come from the node)."""
    model_config: dict[str, Any] | None = None
    """Transformers config keyword arguments (with ``model_type``), instead of a preset."""
    dtype: str = "bfloat16"
    """The rollout dtype the trainer publishes."""
    device: str = "cpu"
    threads: int = 0
    """torch intra-op threads (0: leave torch's default)."""
    vllm: dict[str, Any] = field(default_factory=dict)
    """Extra ``vllm.LLM`` keyword arguments (vLLM engine only; see :mod:`rollout.engines.vllm.engine`)."""

    def __post_init__(self) -> None:
        if not self.engine or not isinstance(self.engine, str):
            raise ConfigError("engine", f"must name an engine, got {self.engine!r}")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ConfigError("dtype", f"must be bfloat16, float16 or float32, got {self.dtype!r}")
        if self.threads < 0:
            raise ConfigError("threads", "must be >= 0")
        if self.model_config is not None and "model_type" not in self.model_config:
            raise ConfigError("model_config", "needs a 'model_type' (e.g. 'qwen3')")

    def hf_config(self) -> Any:
        """The transformers config of the model to build."""
        from transformers import AutoConfig

        if self.model_path:
            return AutoConfig.from_pretrained(self.model_path, local_files_only=True)
        if self.model_config is not None:
            kw = dict(self.model_config)
            return AutoConfig.for_model(kw.pop("model_type"), **kw)
        from p2psync.presets import preset_config

        return preset_config(self.preset)
