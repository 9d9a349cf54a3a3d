"""tools/pytest_report_summary.py (what tools/gpu_check.sh prints after the tests on a GPU machine) and
tools/fit_erf.py (the GELU kernels' erf coefficients)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import fit_erf  # noqa: E402
import pytest_report_summary  # noqa: E402

pytest_plugins = "pytester"


@pytest.mark.parametrize("xdist", [False, True], ids=["one-process", "xdist"])
def test_report_summary_names_each_failure_and_error_with_its_message(pytester, tmp_path, capsys, xdist):
    pytester.makepyfile(
        test_sample="""
        import time
        import pytest
        @pytest.fixture
        def broken():
            raise RuntimeError("the fixture broke")
        def test_passes(): pass
        def test_slow(): time.sleep(0.3)
        def test_fails(): assert 1 == 2, "one is not two"
        def test_errors(broken): pass
        @pytest.mark.skip(reason="not here")
        def test_skipped(): pass
    """
    )
    recorded = pytester.inline_run("-p", "no:cacheprovider")
    log = tmp_path / "tests.jsonl"
    # What pytest-reportlog writes: one JSON object per report, tagged with its type; under
    # pytest-xdist each also names its worker, "node" as a string (which pytest's own rendering of
    # the traceback took for a worker object: the GPU run's summary crashed on its first failure).
    worker = {"worker_id": "gw3", "node": "<WorkerController gw3>"} if xdist else {}
    log.write_text(
        "".join(
            json.dumps(dict(report._to_json(), **worker, **{"$report_type": "TestReport"})) + "\n"
            for report in recorded.getreports("pytest_runtest_logreport")
        )
    )

    assert pytest_report_summary.main([str(log), "--slowest", "2"]) == 0
    out = capsys.readouterr().out
    assert "tests finished: 1 error, 1 failed, 2 passed, 1 skipped" in out
    assert "== FAILED: test_sample.py::test_fails" in out and "one is not two" in out
    assert "== ERROR in setup: test_sample.py::test_errors" in out and "the fixture broke" in out
    assert "test_passes" not in out.split("== slowest")[0]
    slowest = out.split("== slowest 2 (setup + call + teardown)\n")[1].splitlines()
    assert len(slowest) == 2 and slowest[0].endswith("test_sample.py::test_slow")


def _constants_of(path: Path, names: tuple[str, ...]) -> dict:
    """Module-level constants of a source file, read without importing it (the kernel sources
    import TVM's compiler, which must not be loaded beside the prebuilt runtime in this process)."""
    import ast

    tree = ast.parse(path.read_text())
    return {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id in names
    }


def test_the_gelu_kernels_erf_is_the_fit_tools_fit_erf_makes():
    """The coefficients in the kernels are the ones the script fits (reproducible), within the
    accuracy the kernels' docs state."""
    source = Path(__file__).resolve().parents[1] / "tvm_kernels" / "schedules" / "cpu" / "microkernels.py"
    shipped = _constants_of(source, ("_ERF_P", "_ERF_Q", "_ERF_Z_MAX"))
    error, p, q = fit_erf.fit()
    assert error < 1.1e-8 and fit_erf.float32_error(p, q) < 4e-7
    assert p.tolist() == pytest.approx(shipped["_ERF_P"], rel=1e-6)
    assert q.tolist() == pytest.approx(shipped["_ERF_Q"], rel=1e-6)
    assert fit_erf.Z_MAX == shipped["_ERF_Z_MAX"]


def test_the_half_types_erf_is_the_fit_tools_fit_erf_makes():
    """The half types' cheaper erf (P of degree 4, Q of 3): the script's fit, within the 3.7e-6 the
    kernels' docs state (and the GELU tests' bound for the half types assumes)."""
    source = Path(__file__).resolve().parents[1] / "tvm_kernels" / "schedules" / "cpu" / "microkernels.py"
    shipped = _constants_of(source, ("_ERF_P_HALF", "_ERF_Q_HALF"))
    error, p, q = fit_erf.fit(*fit_erf.HALF_DEGREES)
    assert error < 3.5e-6 and fit_erf.float32_error(p, q) < 3.7e-6
    assert p.tolist() == pytest.approx(shipped["_ERF_P_HALF"], rel=1e-6)
    assert q.tolist() == pytest.approx(shipped["_ERF_Q_HALF"], rel=1e-6)
