"""Small verifiable-reward tasks and the character tokenizer they use (built in code, no hub).

Tokenizer. Text is characters of a small alphabet. Every id of the model's
vocabulary decodes to a symbol (``id % len(symbols)``); encoding uses the
smallest id of each symbol. A random-init model with a vocabulary of thousands
therefore starts by sampling roughly uniform *symbols*, not unused ids, so the
very first groups already have rewards that differ (which is all GRPO needs to
start learning) instead of spending most of a run learning to avoid ids no text
uses. The stop symbol's ids are all passed as stop tokens.

Tasks. ``add`` (``"3+4="`` -> ``"7"``), ``add_small`` (operands 0..4, one-digit
answers: learns in a few dozen steps), ``sub`` and ``copy``. Rewards are in
[0, 1]: 1 for the exact answer followed by the stop symbol, with shaping so a
random model gets a signal from its first samples: up to 0.5 for how close the
leading number is, plus 0.1 for a response that is only a number and a stop.

Near misses. :meth:`Task.near_miss` is one fixed wrong response per problem
(the number off by one, the copy with its last digit off by one). A
supervised warm start that imitates the answer and the near miss in equal
measure (:func:`trainer.grpo.warm_start`) gives a policy that hesitates
between the two on every prompt: the setting where a small, consistent
change of the weights shows in the reward.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from p2psync.errors import ConfigError

PAD, BOS, EOS = "\x00", "\x01", "\x02"


class CharTokenizer:
    """Characters of ``alphabet`` plus pad/bos/eos; every id below ``vocab_size`` decodes to one symbol."""

    def __init__(self, vocab_size: int, alphabet: str = "0123456789+-=:") -> None:
        self.symbols = PAD + BOS + EOS + alphabet
        if len(set(self.symbols)) != len(self.symbols):
            raise ConfigError("alphabet", "symbols must be distinct")
        if vocab_size < len(self.symbols):
            raise ConfigError("vocab_size",
                              f"model vocabulary {vocab_size} is smaller than {len(self.symbols)} symbols")
        self.vocab_size = vocab_size
        self._index = {c: i for i, c in enumerate(self.symbols)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2

    @property
    def stop_ids(self) -> list[int]:
        """Every id that decodes to the stop symbol."""
        return list(range(self.eos_id, self.vocab_size, len(self.symbols)))

    def symbol(self, token: int) -> str:
        return self.symbols[token % len(self.symbols)]

    def encode(self, text: str, bos: bool = True) -> list[int]:
        try:
            ids = [self._index[c] for c in text]
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not in the alphabet") from None
        return ([self.bos_id] if bos else []) + ids

    def decode(self, tokens: Sequence[int]) -> tuple[str, bool]:
        """(text up to the first stop symbol, whether a stop symbol was reached); pad/bos read as '?'."""
        out: list[str] = []
        for t in tokens:
            s = self.symbol(int(t))
            if s == EOS:
                return "".join(out), True
            out.append("?" if s in (PAD, BOS) else s)
        return "".join(out), False


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


_LEADING_INT = re.compile(r"-?[0-9]+")


def _number_reward(text: str, ended: bool, answer: str, scale: float) -> float:
    """1 for the exact answer then a stop; else up to 0.5 for how close the leading number is,
    plus 0.1 if the response is just that number and a stop."""
    if text == answer and ended:
        return 1.0
    m = _LEADING_INT.match(text)
    if m is None or len(m.group()) > len(answer) + 1:
        return 0.0
    closeness = max(0.0, 1.0 - abs(int(m.group()) - int(answer)) / scale)
    return 0.5 * closeness + (0.1 if ended and m.group() == text else 0.0)


class Task:
    """A prompt generator plus a verifier."""

    name = ""
    max_new_tokens = 4

    def sample(self, rng: random.Random) -> Problem:
        raise NotImplementedError

    def reward(self, problem: Problem, text: str, ended: bool) -> float:
        raise NotImplementedError

    def near_miss(self, problem: Problem) -> str:
        """A wrong response close to the answer (the same one every time for a problem)."""
        return str(int(problem.answer) + 1)


class Addition(Task):
    def __init__(self, high: int = 9, name: str = "add") -> None:
        self.high, self.name = high, name
        self.max_new_tokens = len(str(2 * high)) + 2

    def sample(self, rng: random.Random) -> Problem:
        a, b = rng.randint(0, self.high), rng.randint(0, self.high)
        return Problem(f"{a}+{b}=", str(a + b))

    def reward(self, problem: Problem, text: str, ended: bool) -> float:
        return _number_reward(text, ended, problem.answer, max(2.0, self.high))


class Subtraction(Task):
    name = "sub"
    max_new_tokens = 4

    def sample(self, rng: random.Random) -> Problem:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return Problem(f"{a}-{b}=", str(a - b))

    def reward(self, problem: Problem, text: str, ended: bool) -> float:
        return _number_reward(text, ended, problem.answer, 9.0)


class Copy(Task):
    """``"c:372="`` -> ``"372"``: reward per matching position, 1 only for the whole string and a stop."""

    name = "copy"
    max_new_tokens = 5

    def sample(self, rng: random.Random) -> Problem:
        s = "".join(rng.choice("0123456789") for _ in range(3))
        return Problem(f":{s}=", s)

    def reward(self, problem: Problem, text: str, ended: bool) -> float:
        if text == problem.answer and ended:
            return 1.0
        hits = sum(a == b for a, b in zip(text, problem.answer))
        return 0.2 * hits + (0.1 if ended else 0.0)

    def near_miss(self, problem: Problem) -> str:
        return problem.answer[:-1] + str((int(problem.answer[-1]) + 1) % 10)


TASKS = {"add": lambda: Addition(9, "add"), "add_small": lambda: Addition(4, "add_small"),
         "sub": Subtraction, "copy": Copy}


def make_task(name: str) -> Task:
    if name not in TASKS:
        raise ConfigError("task", f"unknown task {name!r} (choose from {', '.join(TASKS)})")
    return TASKS[name]()
