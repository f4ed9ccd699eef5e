"""torch.distributed gloo broadcast of the full bf16 weights from rank 0 (the trainer) to every machine.

    python tools/wan/gloo_bcast.py --master IP --rank R --world N --numel E [--weights FILE.safetensors]

Rank 0 loads the weights (a flat bf16 buffer of every published tensor); all
ranks meet at a barrier, then rank 0 broadcasts. Prints one JSON line: the
rank, when the broadcast started (rank 0's clock reading after the barrier is
what the driver uses) and ended (``time.monotonic()``), and a checksum of
what arrived.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--master", required=True)
    ap.add_argument("--port", type=int, default=29500)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--numel", type=int, required=True)
    ap.add_argument("--weights")
    ap.add_argument("--timeout", type=float, default=900)
    a = ap.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{a.master}:{a.port}", rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=a.timeout))
    if a.rank == 0:
        from safetensors.torch import load_file

        flat = torch.cat([t.reshape(-1) for t in load_file(a.weights).values()])
        assert flat.numel() == a.numel and flat.dtype == torch.bfloat16
    else:
        flat = torch.empty(a.numel, dtype=torch.bfloat16)
    dist.barrier()
    t0 = time.monotonic()
    dist.broadcast(flat, src=0)
    t1 = time.monotonic()
    crc = zlib.crc32(flat.view(torch.uint8).numpy().tobytes()[: 1 << 24])
    print(json.dumps({"rank": a.rank, "start": t0, "end": t1, "crc_head": crc}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
