"""The vLLM rollout engine and p2psync's vLLM weight-transfer backend (vLLM 0.32).

- :mod:`.engine`: :class:`~rollout.engines.vllm.engine.VLLMEngine`, the engine the rollout
  worker drives (an offline ``vllm.LLM`` updated through the backend); :mod:`.adapter_engine`, the
  one that follows a LoRA adapter stream over a frozen base.
- :mod:`.launch`: starting vLLM: the ``LLM`` arguments, the refusals before any process starts.
- :mod:`.lora`, :mod:`.pins`, :mod:`.served_adapters`: LoRA adapter versions in vLLM's live slots,
  the versions a staleness window keeps (pinned while requests run), their names on ``vllm serve``.
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
