"""A trainer process does not load the rollout side: importing what the README's trainer snippet uses brings
in neither vLLM nor triton (whose nanobind bindings print leak reports at exit)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_trainer_modules_import_neither_vllm_nor_triton():
    code = ("import sys, json\n"
            "from p2psync import config\n"
            "from trainer.background import BackgroundNode\n"
            "from trainer.publisher import Publisher\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'triton', 'rollout'))))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
