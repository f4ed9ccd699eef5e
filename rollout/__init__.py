"""The rollout side: engines that hold the trainer's exact bits (:mod:`rollout.engines`: the
contract, a registry by name, transformers and vLLM backends) and the worker job a rollout node
runs (:mod:`rollout.worker`). See docs/ROLLOUT.md."""
