"""scripts/device_check.sh, the prepared GPU run, dry-run here on the CPU.

The script is run for real (a small state, one round, a few test files): every step, the one
JSON it writes, and a run whose steps fail, which must end non-zero naming them, not pass with
its GPU tests skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.gpu import REQUIRE

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "device_check.sh"
sys.path.insert(0, str(ROOT / "scripts"))
import device_report  # noqa: E402


def device_check(out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != REQUIRE}
    base.update(OUT=str(out), WHEELS="none", BENCH_ROUNDS="1",
                BENCH_DIR=str(out / "bench-dir"),
                PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    base.update(env)
    return subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=base, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow  # 30 s: the whole script (wheels, tests, the benchmark) on a small state
def test_the_dry_run_passes_every_step_and_writes_one_json(tmp_path: Path) -> None:
    run = device_check(tmp_path, DEVICE_TESTS="tests/test_cuda.py tests/test_descriptor.py",
                       BENCH_ARGS="--device cpu --scale 32")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.rstrip().endswith("device check: every step passed")
    report = json.loads((tmp_path / "device-check.json").read_text())
    assert report["ok"] is True
    assert [s["name"] for s in report["steps"]] == ["machine", "tests", "bench"]
    assert all(s["rc"] == 0 and s["seconds"] > 0 for s in report["steps"])
    assert "torch" in report["machine"]
    tests = report["tests"]
    assert tests["failures"] == tests["errors"] == 0 and tests["passed"] > 0
    if not torch.cuda.is_available():  # here the CUDA tests skip, and are listed as skipped
        assert tests["skipped"] > 0
        assert all(s["test"].startswith("tests.test_cuda") for s in tests["skipped_tests"])
    bench = report["bench"]
    assert bench["state"] == "h200" and bench["rounds"] == 1
    for system in ("ciuic", "dcp.async_save", "torch.save"):
        for key in ("stall", "durable", "load"):
            assert len(bench["results"][system][key]) == 1
    assert any(k.startswith("later stall") for k in bench["ratios"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="here CUDA is there: the tests run")
def test_a_gpu_check_whose_cuda_tests_cannot_run_fails_naming_the_steps(tmp_path: Path) -> None:
    """CIUIC_REQUIRE_CUDA=1 (what the script sets where nvidia-smi finds a GPU) with a torch that
    cannot use CUDA: the CUDA tests fail at collection instead of skipping; and a benchmark that
    cannot run fails its step. The run goes on through every step and ends non-zero."""
    run = device_check(tmp_path, DEVICE_TESTS="tests/test_cuda.py",
                       BENCH_ARGS="--state no-such-state", **{REQUIRE: "1"})
    assert run.returncode == 1, run.stdout[-3000:]
    assert run.stdout.rstrip().splitlines()[-1].startswith("device check FAILED: tests, bench")
    report = json.loads((tmp_path / "device-check.json").read_text())
    assert report["ok"] is False
    assert {s["name"]: s["ok"] for s in report["steps"]} == {
        "machine": True, "tests": False, "bench": False}
    assert report["tests"]["errors"] == 1
    assert "CIUIC_REQUIRE_CUDA=1" in (tmp_path / "tests.log").read_text()
    assert "no-such-state" in (tmp_path / "bench-h200.log").read_text()


def write(out: Path, cases: str, steps: str = "tests\t0\t1500\ttests.log\n") -> None:
    (out / "steps.tsv").write_text(steps)
    (out / "tests.xml").write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="2" failures="0" '
        f'errors="0" skipped="1">{cases}</testsuite></testsuites>')


def test_with_a_gpu_a_skipped_gpu_test_fails_the_report(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path, '<testcase classname="tests.test_engine" name="test_a"/>'
                    '<testcase classname="tests.test_cuda_megatron" name="test_b">'
                    '<skipped message="megatron-core missing"/></testcase>')
    assert device_report.main([str(tmp_path)]) == 0  # no GPU: a skip is what it should do
    assert device_report.main([str(tmp_path), "--gpu"]) == 1
    report = json.loads((tmp_path / "device-check.json").read_text())
    assert report["steps"][0]["ok"] is False
    assert "1 GPU test(s) skipped" in report["steps"][0]["why"]
    assert "skipped on a GPU machine: tests.test_cuda_megatron::test_b" in capsys.readouterr().out


def test_a_skipped_cpu_test_and_a_failed_step_are_told_apart(tmp_path: Path) -> None:
    write(tmp_path, '<testcase classname="tests.test_engine" name="test_a">'
                    '<skipped message="no root"/></testcase>'
                    '<testcase classname="tests.test_cuda" name="test_b"/>',
          steps="tests\t0\t1500\ttests.log\nbench\t2\t300\tbench-h200.log\n")
    assert device_report.main([str(tmp_path), "--gpu"]) == 1  # the bench failed
    report = json.loads((tmp_path / "device-check.json").read_text())
    assert [s["ok"] for s in report["steps"]] == [True, False]
    assert report["tests"]["passed"] == 1 and report["bench"] is None
