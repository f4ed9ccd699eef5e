"""``p2psync demo`` options reach the trainer job as GRPO options."""
from __future__ import annotations

from pathlib import Path

import pytest

from p2psync.cli import build_parser
from p2psync.demo.run import _trainer_options
from trainer.grpo import GRPOOptions


def _opts(tmp_path: Path, *argv: str) -> GRPOOptions:
    args = build_parser().parse_args(["demo", *argv])
    opts = _trainer_options(args, tmp_path)
    assert opts.pop("done_path")  # the demo's job wrapper takes this one (p2psync.demo.jobs)
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
