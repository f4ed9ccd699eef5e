"""tools/mutation_check.py: the mutants it makes are the bugs it names, and each breaks the code."""

from __future__ import annotations

from pathlib import Path

import pytest

SRC = '''\
LIMIT = 3


def take(xs, n=2):
    if n < 0:
        raise ValueError("n")
    if len(xs) > LIMIT and n:
        return xs[: n + 1]
    return xs
'''


@pytest.fixture
def mc(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "tools"))
    import mutation_check

    return mutation_check


def _run(source: str, *args):
    ns: dict = {}
    exec(compile(source, "<mutant>", "exec"), ns)
    try:
        return ns["take"](*args)
    except ValueError:
        return "ValueError"


def test_every_meaningful_mutant_changes_what_the_code_does(mc):
    found = mc.meaningful_sites(SRC, set(range(1, 10)))
    ops = sorted(op for _, _, op in found)
    assert ops == sorted(["check dropped", "If condition negated", "Lt -> GtE", "boundary Lt -> LtE",
                          "Gt -> LtE", "boundary Gt -> GtE", "And swapped", "off by one (Add 1 dropped)",
                          "return None", "return None"])
    inputs = [([1, 2, 3, 4, 5], 2), ([1], -1), ([1, 2, 3, 4], 0), ([1, 2, 3], 1), ([1, 2, 3, 4], 1)]
    want = [_run(SRC, *i) for i in inputs]
    assert want == [[1, 2, 3], "ValueError", [1, 2, 3, 4], [1, 2, 3], [1, 2]]
    for k, _, op in found:
        mutant = mc.mutate(SRC, k, op)
        assert [_run(mutant, *i) for i in inputs] != want, op
    # no setting (LIMIT, the default n) is a site
    assert all(line not in (1, 4) for _, line, _ in found)


def test_no_setting_is_a_site_of_either_kind(mc):
    # a module constant's or a default's arithmetic is a setting too, not only a bare constant
    src = "LIMIT = 2 + 1\n\n\ndef f(x, n=1 - 0):\n    return x + LIMIT\n"
    for find in (mc.sites, mc.meaningful_sites):
        assert {line for _, line, _ in find(src, {1, 2, 3, 4, 5})} == {5}, find.__name__


def test_a_commands_return_0_is_no_site(mc):
    # sys.exit(None) exits 0 as sys.exit(0) does: that mutant could never be killed
    src = "def main(argv):\n    if argv:\n        return 2\n    return 0\n"
    assert [(line, op) for _, line, op in mc.meaningful_sites(src, {2, 3, 4}) if op == "return None"] == [(3, "return None")]


def test_a_dropped_check_no_longer_raises_and_the_rest_is_unchanged(mc):
    (k, line, _), = [s for s in mc.meaningful_sites(SRC, set(range(1, 10))) if s[2] == "check dropped"]
    assert line == 5
    mutant = mc.mutate(SRC, k, "check dropped")
    assert _run(mutant, [1], -1) == [1]
    assert _run(mutant, [1, 2, 3, 4, 5], 2) == [1, 2, 3]
    # a test that never reached the raise (valid input only) gets no mutant of that check
    ops = [op for _, _, op in mc.meaningful_sites(SRC, set(range(1, 10)), ran={5, 7, 8, 9})]
    assert "check dropped" not in ops and "If condition negated" in ops
    ops = [op for _, _, op in mc.meaningful_sites(SRC, set(range(1, 10)), ran={5, 6})]
    assert "check dropped" in ops


def test_aimed_sites_are_in_the_code_the_test_names_one_module_each_first(mc):
    import random

    root = Path(__file__).resolve().parents[2]
    run = (root / "p2psync/probe/run.py").read_text().splitlines()
    check = next(i for i, ln in enumerate(run, 1) if "if options.bytes <= 0" in ln)
    facade = (root / "p2psync/node/facade.py").read_text().splitlines()
    ret = next(i for i, ln in enumerate(facade, 1) if "return self._tasks.failure" in ln)
    pool = [("p2psync/node/facade.py", 0, ret, "return None"), ("p2psync/probe/run.py", 0, check, "check dropped"),
            ("p2psync/probe/run.py", 1, check, "If condition negated")]
    text = "def test_probe_refuses_zero_bytes():\n    with pytest.raises(ConfigError): probe(...)\n"
    for seed in range(5):
        got = mc.aimed(pool, text, 2, random.Random(seed))
        assert got[0] == pool[1]  # the probe module, its checked function, and the test expects errors
        assert got[1] == pool[0]  # another module before a second site of the same
    assert len(mc.aimed(pool, text, 5, random.Random(0))) == 3


def test_which_assertion_failed_is_kept_past_a_long_log(mc, tmp_path):
    """A failing run whose processes log a lot and whose assertion message is long still says which
    statement failed (the chaos soak's baseline said only "1 failed")."""
    (tmp_path / "test_noisy.py").write_text(
        "import subprocess, sys\n\n\ndef test_noisy():\n"
        "    detail = {'log': 'x' * 3000}\n"
        "    subprocess.run([sys.executable, '-c', \"import sys; sys.stderr.write('node log\\\\n' * 500)\"])\n"
        "    wall_s = 230\n"
        "    assert detail and wall_s <= 200, detail\n")
    import sys

    run = mc.Runner(sys.executable, None, 60.0)
    how, _, tail = mc._pytest(run, [str(tmp_path / "test_noisy.py")], 60.0)
    said = mc._first_error(tail, how)
    assert how == "failed"
    assert "test_noisy" in said and "wall_s <= 200" in said, said
    assert mc._first_error("1 passed", "passed") == "passed"


def test_a_keyword_runs_only_the_cases_it_names(mc, tmp_path):
    """``-k``: a file whose cases each load a model is judged on the few named (the others, here a
    failing one, do not run)."""
    import sys

    f = tmp_path / "test_cases.py"
    f.write_text("import pytest\n\n\n@pytest.mark.parametrize('family', ['llama', 'gpt2'])\n"
                 "def test_family(family):\n    assert family == 'llama'\n")
    assert mc._pytest(mc.Runner(sys.executable, None, 60.0, "llama"), [str(f)], 60.0)[0] == "passed"
    assert mc._pytest(mc.Runner(sys.executable, None, 60.0), [str(f)], 60.0)[0] == "failed"


def test_a_coverage_record_of_another_checkout_is_refused(mc, tmp_path, capsys):
    """Coverage keeps absolute paths: a record made in another checkout would leave nothing alone, and
    every file would be judged on the lines the unit tests run too."""
    import coverage

    data = coverage.CoverageData(basename=str(tmp_path / "unit.cov"))
    data.add_lines({"/elsewhere/p2psync/lease.py": [1, 2, 3]})
    data.write()
    assert mc.main(["--integration", "--exclude-covered-by", str(tmp_path / "unit.cov"),
                    "--json", str(tmp_path / "out.json"), "tests/integration/test_cli_errors.py"]) == 2
    assert "another checkout" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()
