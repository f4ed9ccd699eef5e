"""The trainer's workload in the chaos soak: small safetensors checkpoints, ~1 % of the words changed
per version, handed to ``p2psync publish`` (the operator's way to feed a trainer node's publish
folder with no Python training loop): by default its code in this process
(:func:`p2psync.publish_files.publish`, what the command runs), or the command itself
(``cli=True``: a process per version, whose start costs seconds on a loaded 2-core host). The
truth of each version is its fingerprint, computed here from the tensors before the checkpoint
is published."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

CLI = [sys.executable, "-c", "import sys; from p2psync.cli import main; sys.exit(main())"]


class Checkpoints:
    """bf16 tensors of ``numel`` elements in all; :meth:`step` flips ``fraction`` of the words."""

    def __init__(self, folder: Path, numel: int, fraction: float = 0.01, seed: int = 0) -> None:
        import torch

        self.folder = folder
        self.fraction = fraction
        self.gen = torch.Generator().manual_seed(seed)
        sizes = {"embed.weight": (max(1, numel // 2000), 1000), "layers.0.mlp.weight": (max(1, numel // 4000), 1000),
                 "layers.0.mlp.bias": (1000,), "norm.weight": (max(1, numel // 4),)}
        self.tensors = {n: torch.randn(*s, generator=self.gen).to(torch.bfloat16) for n, s in sizes.items()}
        self.step_no = 0

    def step(self) -> None:
        import torch

        for t in self.tensors.values():
            flat = t.view(torch.int16).reshape(-1)
            mask = torch.rand(flat.shape[0], generator=self.gen) < self.fraction
            flat[mask] ^= torch.randint(1, 64, (int(mask.sum()),), generator=self.gen, dtype=torch.int16)
        self.step_no += 1

    def save(self) -> tuple[Path, str]:
        """Write the current weights; returns the file and their fingerprint (the truth)."""
        from safetensors.torch import save_file

        from p2psync.state import ModelState

        path = self.folder / f"step-{self.step_no:06d}.safetensors"
        save_file(self.tensors, str(path))
        for old in self.folder.glob("step-*.safetensors"):  # keep the one `publish` names as its base
            if old.name < f"step-{self.step_no - 1:06d}":
                old.unlink()
        # The checkpoint's table is ordered by name (p2psync.checkpoint.load), and so is the fingerprint.
        return path, ModelState(dict(sorted(self.tensors.items()))).fingerprint


_LINE = re.compile(r": version (\d+), .* fingerprint ([0-9a-f]+),")


def publish(ckpt: Path, publish_dir: Path, key: Path, env: dict[str, str], timeout: float = 120.0,
            cli: bool = False) -> tuple[int, str]:
    """``p2psync publish CKPT``; returns (version, fingerprint) as it printed them."""
    if not cli:
        from p2psync import keys, publish_files
        from p2psync.codec.encode import CodecOptions

        m, _, _ = publish_files.publish(str(ckpt), publish_dir, keys.load_private(str(key)),
                                        CodecOptions(chunk_size=256 << 10, threads=1))
        return m.target_version, m.target_fingerprint
    out = subprocess.run([*CLI, "publish", str(ckpt), "--publish-dir", str(publish_dir), "--key", str(key),
                          "--chunk-size", "256KiB", "--threads", "1"], capture_output=True, text=True,
                         timeout=timeout, env=env, check=False)
    m = _LINE.search(out.stdout)
    if out.returncode != 0 or m is None:
        raise RuntimeError(f"p2psync publish failed ({out.returncode}): {(out.stderr or out.stdout)[-500:]}")
    return int(m.group(1)), m.group(2)
