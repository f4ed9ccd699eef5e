"""The errors of :mod:`topology`: its inputs (network models, probe plans, planner options) are
checked field by field, and a bad one raises :class:`ModelError` naming the field."""

from __future__ import annotations


class TopologyError(ValueError):
    """Base of the errors :mod:`topology` raises."""


class ModelError(TopologyError):
    """A value of a network model, a probe plan or the planner's options is invalid; ``field``
    names it (``links[3].dst``), and the message starts with it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
