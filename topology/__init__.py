"""Who pulls from whom: the network model, the planner, the flow simulator and the topology picture.

- :mod:`topology.model`: nodes, capacities, measured and estimated links (networkx).
- :mod:`topology.model_types`: the value types a model is built from and their checks;
  :mod:`topology.model_json`: the model's JSON file format.
- :mod:`topology.synthetic`: seeded realistic models for tests and the scale study.
- :mod:`topology.tree`: the :class:`~topology.tree.Plan` and the completion-time estimate it is scored by.
- :mod:`topology.planner` / :mod:`topology.replan`: build a plan; repair it after joins and failures.
- :mod:`topology.incremental`: :class:`~topology.incremental.Replanner`, the repair one change at a
  time (failure, join, re-measured link, partitioned region) in time proportional to what it touches.
- :mod:`topology.vector`, :mod:`topology.fanout`: the estimate and a region's fan-out over numpy arrays.
- :mod:`topology.simulator`, :mod:`topology.baselines`: score trees by max-min fair flow simulation
  against the star, random and fixed-tier trees and the lower bounds.
- :mod:`topology.viz`, :mod:`topology.report`: the picture and the text views.

- :mod:`topology.probeplan`: which node pairs a probe run measures, in rounds that do not disturb each other.
- :mod:`topology.errors`: :class:`~topology.errors.ModelError`, naming the field of a bad input.

Pure and self-contained: no sockets, no clocks, no import of p2psync. A probe run
(:mod:`p2psync.probe.run`, ``p2psync plan --probe``) produces a list of
:class:`~topology.model.Measurement` and :func:`~topology.model.model_from_measurements`
turns it into a model.
"""
