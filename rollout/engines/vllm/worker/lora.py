"""LoRA adapter versions into a vLLM worker's live LoRA slots, from memory (no adapter folder).

Module-level functions that vLLM's workers run through ``collective_rpc``. vLLM loads an
adapter from a folder the first time a request names its ``lora_int_id`` and reuses it while
that id is registered in the worker's LoRA manager; these functions register an adapter version
under its own id from the tensors a p2psync stream delivered
(``LoRAModel.from_lora_tensors``, vLLM's own constructor, with the checks its folder path makes),
pin it in the registered-adapter cache so that vLLM's LRU never evicts it behind the caller's back, and remove versions the
caller's staleness window dropped. A request naming a registered id is then served from memory.

Every refusal is reported before anything is registered (``{"ok": False, "kind": ..., "reason":
...}``; the caller raises the typed error), so the loaded set is untouched.
"""

from __future__ import annotations

from typing import Any


def _manager(worker: Any) -> Any:
    """The worker's ``WorkerLoRAManager`` (an error when the engine was built without LoRA)."""
    inner = getattr(worker, "worker", worker)
    runner = getattr(inner, "model_runner", None)
    mgr = getattr(runner, "lora_manager", None)
    if mgr is None:
        raise RuntimeError("this vLLM engine serves no LoRA (build it with enable_lora=True)")
    return mgr


def _expected_modules(mgr: Any) -> set[str]:
    """The module names the engine serves LoRA on, as vLLM's folder loader expects them."""
    am = mgr._adapter_manager
    out: set[str] = set()
    for module in am.supported_lora_modules:
        out.update(am.packed_modules_mapping.get(module, [module]))
        if module == "experts":
            out.add(module)
    return out


def rpc_lora_limits(worker: Any) -> dict[str, Any]:
    """What the engine's LoRA config lets an adapter be: ``max_lora_rank``, ``modules`` it serves
    LoRA on, ``max_cpu_loras`` (registered adapters it holds) and ``registered`` ids."""
    mgr = _manager(worker)
    return {"max_lora_rank": mgr.lora_config.max_lora_rank, "modules": sorted(_expected_modules(mgr)),
            "max_cpu_loras": mgr._adapter_manager.capacity, "registered": sorted(mgr.list_adapters())}


def rpc_lora_add(worker: Any, lora_int_id: int, peft_config: dict[str, Any],
                 tensors: dict[str, tuple[str, list[int], bytes]], remove: list[int] | None = None) -> dict[str, Any]:
    """Register the adapter ``tensors`` (PEFT name -> (dtype code, shape, raw bytes)) with
    ``peft_config`` (its ``adapter_config.json``) under ``lora_int_id`` and pin it; then, only if
    that succeeded, remove the adapters ``remove`` (the versions the caller's window drops: one
    round trip to the worker per version instead of two). A refusal removes nothing."""
    mgr = _manager(worker)
    am = mgr._adapter_manager
    if lora_int_id in mgr.list_adapters():
        return {"ok": False, "kind": "exists", "reason": f"lora_int_id {lora_int_id} is already registered"}
    lora = lora_model(mgr, lora_int_id, peft_config, tensors)
    if isinstance(lora, dict):
        return lora
    if len(am) >= am.capacity:
        # As vLLM's own add does: the least recently used adapter that is not pinned (one loaded
        # from a folder) makes room; pinned versions are the callers' to remove.
        try:
            am.remove_oldest_adapter()
        except (RuntimeError, ValueError):
            pass
        if len(am) >= am.capacity:
            return {"ok": False, "kind": "capacity",
                    "reason": f"{len(am)} adapter versions pinned, the engine holds {am.capacity} (max_cpu_loras)"}
    am.add_adapter(lora)
    # Pinned in the registered (CPU) cache only: vLLM's pin_adapter also pins a GPU slot, and
    # max_loras pinned versions would leave no slot for any other adapter a batch names.
    am._pin_lora_in_cpu_cache(lora_int_id)
    for i in remove or ():
        mgr.remove_adapter(i)
    return {"ok": True}


def lora_model(mgr: Any, lora_int_id: int, peft_config: dict[str, Any],
               tensors: dict[str, tuple[str, list[int], bytes]]) -> Any:
    """vLLM's ``LoRAModel`` of the adapter ``tensors`` (PEFT name -> (dtype code, shape, raw bytes))
    with ``peft_config``, built in memory under ``lora_int_id`` with the checks vLLM's folder load
    makes against the engine's LoRA config (``mgr``: the worker's ``WorkerLoRAManager``); or a
    refusal ``{"ok": False, "kind": ..., "reason": ...}``. Registers nothing."""
    import torch
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    from p2psync import dtypes

    am = mgr._adapter_manager
    targets = set(peft_config.get("target_modules") or ())
    served = _expected_modules(mgr)
    if not targets <= served:
        return {"ok": False, "kind": "targets",
                "reason": f"target modules {sorted(targets - served)} are not served with LoRA by this engine "
                          f"(it serves {sorted(served)})"}
    try:
        helper = PEFTHelper.from_dict({**peft_config, "vllm_max_position_embeddings": mgr.max_position_embeddings})
        helper.validate_legal(mgr.lora_config)
    except ValueError as exc:
        return {"ok": False, "kind": "config", "reason": str(exc)}
    loaded: dict[str, torch.Tensor] = {}
    for name, (code, shape, raw) in tensors.items():
        dt = dtypes.from_code(code).torch_dtype()
        loaded[name] = torch.frombuffer(bytearray(raw), dtype=dt).reshape(shape)
    model = am.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    try:
        lora = LoRAModel.from_lora_tensors(
            lora_int_id, loaded, helper, device="cpu", dtype=mgr.lora_config.lora_dtype,
            model_vocab_size=mgr.vocab_size, weights_mapper=mapper.get_rename_mapper() if mapper else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None))
        am._validate_modules_to_save(lora)
    except ValueError as exc:
        return {"ok": False, "kind": "config", "reason": str(exc)}
    return lora


def rpc_lora_remove(worker: Any, lora_int_ids: list[int]) -> list[int]:
    """Remove the adapters ``lora_int_ids`` (those registered); returns the ids still registered."""
    mgr = _manager(worker)
    for i in lora_int_ids:
        mgr.remove_adapter(i)
    return sorted(mgr.list_adapters())
