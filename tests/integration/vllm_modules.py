"""Real vLLM model modules built in this process from a tiny checkpoint, without an engine.

``get_model`` runs vLLM's own model class, loader and post-load processing (the
CPU platform's), as a worker does, in a few seconds instead of the ~25 s an
``LLM`` takes. One process-wide world of size 1 (gloo) serves every model.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

_READY = False


def _world() -> None:
    global _READY
    if _READY:
        return
    import torch
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    # The CPU worker makes these no-ops; outside it torch raises on a machine without an accelerator.
    torch.accelerator.empty_cache = lambda: None  # type: ignore[assignment]
    torch.accelerator.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
    ensure_model_parallel_initialized(1, 1)
    _READY = True


def vllm_model(model_dir: str, keep_onednn: bool = False, timing: dict[str, float] | None = None,
               **engine: Any) -> Any:
    """vLLM's model for the checkpoint ``model_dir``, loaded as the p2psync plugin leaves the CPU build
    (plain linear weights; ``keep_onednn``: repacked as vLLM does by default); ``engine``: extra
    ``EngineArgs``; ``timing``: gets ``get_model_s``, the seconds of vLLM's ``get_model`` alone (build,
    read, load, post-load processing; not the imports and config before it)."""
    import vllm._custom_ops as ops
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model

    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    import torch

    keep = ops._supports_onednn
    args_onednn = keep_onednn and hasattr(torch.ops._C, "create_onednn_mm_handler")
    args = EngineArgs(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256,
                      enforce_eager=True, **engine)
    vc = args.create_engine_config()
    try:
        ops._supports_onednn = args_onednn
        with set_current_vllm_config(vc):
            _world()
            t = time.perf_counter()
            model = get_model(vllm_config=vc)
            if timing is not None:
                timing["get_model_s"] = time.perf_counter() - t
            return model
    finally:
        ops._supports_onednn = keep
