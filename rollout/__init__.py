"""The rollout side: engines that hold the trainer's exact bits (:mod:`rollout.engine` contract,
:mod:`rollout.hf` transformers, :mod:`rollout.vllm` vLLM) and the worker job a rollout node runs
(:mod:`rollout.worker`). See docs/ROLLOUT.md."""
