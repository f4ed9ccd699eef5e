"""The publish folder's log: a file the trainer already holds is said once, not again with every version
the trainer moves on (found by the chaos soak, tools/chaos.py: after a trainer restart every old file of
the folder was logged again at each new version, 3,648 lines in six minutes)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

from p2psync import keys
from p2psync.artifact import write_file
from p2psync.node.publish_dir import PublishDir
from tests.unit.p2psync.test_node_publish import _artifacts, _configs, _states


def test_files_older_than_the_trainers_version_are_said_once(tmp_path, caplog):
    priv, _, _ = _configs(tmp_path)
    arts = _artifacts(priv, _states())
    d = tmp_path / "publish"
    d.mkdir()
    for m, chunks in arts:
        write_file(d / f"{m.target_version:08d}.p2sa", m, chunks)
    log = logging.getLogger("test.publish_dir")
    replica = SimpleNamespace(version=3, fingerprint=arts[3][0].target_fingerprint)
    # A restarted trainer: its weights are version 3 and up, the artifacts of the folder pruned from its store.
    origin = SimpleNamespace(log=log, public_key=keys.load_public(tmp_path / "keys" / "trainer.pub"),
                             replica=replica, store=SimpleNamespace(artifacts={}))
    pd = PublishDir(d, origin)  # type: ignore[arg-type]

    async def go() -> None:
        for v in range(3, 9):  # the trainer moves on (its newer versions came from elsewhere)
            replica.version = v
            await pd.step()

    with caplog.at_level(logging.INFO, logger="test.publish_dir"):
        asyncio.run(go())
    lines = [r.getMessage() for r in caplog.records]
    for m, _ in arts:
        name = f"{m.target_version:08d}.p2sa"
        said = [x for x in lines if name in x]
        assert said == [f"publish-dir: {name} skipped: version {m.target_version} is not newer than the "
                        f"trainer's version 3"], lines
