"""Bandwidth and RTT probes between live nodes, the input of the planner (:mod:`topology`).

- :mod:`.service`: the probe endpoints every node serves (ping, blob, measure) and the client
  that calls them.
- :mod:`.run`: a probe run (``p2psync plan --probe``): learn who the nodes are, have them
  measure each other in non-interfering rounds, and build :class:`topology.model.NetworkModel`.
"""
