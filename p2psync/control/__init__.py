"""The live control plane: gossip, coordinator and rollout-work services on the node's HTTP server.

:mod:`p2psync.control.api` is the contract between the control plane and its
users (the trainer's work sink, the rollout worker's work source).
"""
