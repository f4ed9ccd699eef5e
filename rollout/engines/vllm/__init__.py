"""The vLLM rollout engine and p2psync's vLLM weight-transfer backend (vLLM 0.32).

- :mod:`.engine`: :class:`~rollout.engines.vllm.engine.VLLMEngine`, the engine the rollout
  worker drives (an offline ``vllm.LLM`` updated through the backend).
- :mod:`.plugin`: vLLM's ``general_plugins`` entry point; registers the backend by name.
- :mod:`.worker`: what runs inside vLLM's worker processes: the ``p2psync`` backend, the init
  and update requests it accepts, its fetch from a p2psync parent, staging, warm-up.
- :mod:`.placement`: where each checkpoint element lives in vLLM's live parameters, learnt
  from vLLM's own loaders (and cached on disk).
- :mod:`.apply`: decoding a verified delta against the live words and committing it, all or
  nothing across tensor- and expert-parallel ranks.

Layers point down: engine -> plugin -> worker -> apply -> placement. Nothing here imports vLLM at
module level except the backend (:mod:`.worker.backend`), which vLLM imports when chosen.
"""
