"""An emulated multi-region WAN on one Linux host: one network namespace per machine.

Facade: :class:`Testbed` (``Testbed.up(cfg)`` / ``Testbed.attach(name)``, then
``spawn``/``run`` any command inside a machine's namespace, ``down``).
Parts: :mod:`.config` (the description and address plan, pure), :mod:`.netns`
(build, state file, teardown), :mod:`.delay` (the user-space delay line that
stands in for ``netem``), :mod:`.model` (the testbed as a
:class:`topology.model.NetworkModel` for the planner).

Needs root and iproute2 (``ip``, ``tc``); see docs/benchmarks/wan.md for what
the emulation reproduces and what it lacks.
"""

from __future__ import annotations

from p2psync.testbed.config import Machine, TestbedConfig, load
from p2psync.testbed.errors import TestbedError
from p2psync.testbed.runner import Testbed

__all__ = ["Machine", "Testbed", "TestbedConfig", "TestbedError", "load"]
