"""``p2psync demo`` options reach the trainer job as GRPO options."""
from __future__ import annotations

from pathlib import Path

import pytest

from p2psync.cli import build_parser
from demo.run import _trainer_options
from trainer.grpo import GRPOOptions


def _opts(tmp_path: Path, *argv: str) -> GRPOOptions:
    args = build_parser().parse_args(["demo", *argv])
    opts = _trainer_options(args, tmp_path)
    assert opts.pop("done_path")  # the demo's job wrapper takes this one (demo.jobs)
    return GRPOOptions.from_dict(opts)


@pytest.mark.parametrize(("flag", "want"), [(None, None), ("auto", None), ("on", True), ("off", False)])
def test_publish_first_reaches_the_trainer(tmp_path: Path, flag: str | None, want: bool | None) -> None:
    argv = [] if flag is None else ["--publish-first", flag]
    opts = _opts(tmp_path, "--max-staleness", "2", *argv)
    assert opts.publish_first is want
    assert opts.max_staleness == 2


def test_an_unknown_publish_first_value_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["demo", "--publish-first", "sometimes"])
    assert e.value.code == 2
    assert "--publish-first" in capsys.readouterr().err


def test_the_default_is_the_showcase_and_quick_is_small(tmp_path: Path) -> None:
    show = _opts(tmp_path)
    assert show.preset == "demo" and show.warm_start_steps > 0 and show.lr < 1e-3
    quick = _opts(tmp_path, "--quick")
    assert quick.preset == "mini" and quick.warm_start_steps == 0 and quick.steps < show.steps
    # an explicit option wins over the profile
    assert _opts(tmp_path, "--quick", "--steps", "7", "--lr", "0.5").steps == 7
    assert _opts(tmp_path, "--quick", "--lr", "0.5").lr == 0.5


def test_the_demo_model_suits_vllm_cpu_attention() -> None:
    from p2psync.presets import PRESETS

    for name in ("demo", "mini"):
        assert PRESETS[name]["head_dim"] in (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)
