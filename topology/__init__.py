"""Who pulls from whom: the network model, the planner, the flow simulator and the topology picture.

- :mod:`topology.model`: nodes, capacities, measured and estimated links (networkx), JSON.
- :mod:`topology.synthetic`: seeded realistic models for tests and the scale study.
- :mod:`topology.tree`: the :class:`~topology.tree.Plan` and the completion-time estimate it is scored by.
- :mod:`topology.planner` / :mod:`topology.replan`: build a plan; repair it after joins and failures.
- :mod:`topology.simulator`, :mod:`topology.baselines`: score trees by max-min fair flow simulation
  against the star, random and fixed-tier trees and the lower bounds.
- :mod:`topology.viz`, :mod:`topology.report`: the picture and the text views.

- :mod:`topology.probeplan`: which node pairs a probe run measures, in rounds that do not disturb each other.
- :mod:`topology.prober`: the one module with I/O: has live nodes measure each other (``p2psync plan --probe``).

Everything else here is pure (no sockets, no clocks); a probe run produces a
list of :class:`~topology.model.Measurement` and
:func:`~topology.model.model_from_measurements` turns it into a model.
"""
