"""The one JSON of a GPU check (scripts/device_check.sh): every step, the tests, the benchmark.

    python3 scripts/device_report.py OUT [--gpu]

Reads what device_check.sh left in OUT (``steps.tsv``: a step's name, exit status,
milliseconds and log per line; ``tests.xml``: pytest's JUnit report; ``bench-h200.json``;
``machine.txt``), writes ``OUT/device-check.json`` and exits 1 when a step failed, naming it
and the failed tests on the last lines. ``--gpu`` (a GPU is on the machine): a GPU test
(tests/test_cuda*.py) that skipped counts as a failure of the tests step. Only the standard
library: it runs on the lent machine's own Python before anything else is known to work there.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any


def steps(out: Path) -> list[dict[str, Any]]:
    rows = []
    for line in (out / "steps.tsv").read_text().splitlines():
        name, rc, ms, log = line.split("\t")
        rows.append({"name": name, "rc": int(rc), "seconds": int(ms) / 1000, "log": log,
                     "ok": rc == "0"})
    return rows


def tests(out: Path) -> dict[str, Any] | None:
    """pytest's counts, and each failed or erroring test with the first line of its message."""
    path = out / "tests.xml"
    if not path.exists():
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites)
              for k in ("tests", "failures", "errors", "skipped")}
    failed, skipped = [], []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        for tag in ("failure", "error"):
            bad = case.find(tag)
            if bad is not None:
                failed.append({"test": name, "kind": tag,
                               "message": (bad.get("message") or "").splitlines()[:1]})
        skip = case.find("skipped")
        if skip is not None:
            skipped.append({"test": name, "reason": skip.get("message", "")})
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"]
            - counts["skipped"], "failed": failed, "skipped_tests": skipped}


def bench(out: Path) -> dict[str, Any] | None:
    path = out / "bench-h200.json"
    if not path.exists():
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def gpu_tests_skipped(t: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The GPU tests that skipped (with a GPU present, each a failure)."""
    if t is None:
        return []
    return [s for s in t["skipped_tests"] if s["test"].startswith("tests.test_cuda")]


def main(argv: list[str]) -> int:
    gpu = "--gpu" in argv
    args = [a for a in argv if a != "--gpu"]
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(args[0])
    ran = steps(out)
    skipped = gpu_tests_skipped(tests(out)) if gpu else []
    for s in ran:
        if s["name"] == "tests" and skipped:
            s["ok"] = False
            s["why"] = f"{len(skipped)} GPU test(s) skipped on a machine with a GPU"
    machine = out / "machine.txt"
    t = tests(out)
    report: dict[str, Any] = {
        "ok": bool(ran) and all(s["ok"] for s in ran),
        "steps": ran,
        "machine": machine.read_text() if machine.exists() else None,
        "gpu": gpu,
        "tests": t,
        "bench": bench(out),
    }
    (out / "device-check.json").write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out / 'device-check.json'}")
    for s in ran:
        state = "ok" if s["ok"] else f"FAILED (exit {s['rc']})"
        print(f"  {s['name']:<8} {state:<18} {s['seconds']:7.1f} s  {s['log']}"
              + (f"  {s['why']}" if "why" in s else ""))
    if t is not None:
        print(f"  tests: {t['passed']} passed, {t['failures'] + t['errors']} failed, "
              f"{t['skipped']} skipped")
        for f in t["failed"]:
            print(f"    {f['kind']}: {f['test']}: {' '.join(f['message'])}")
        for f in skipped:
            print(f"    skipped on a GPU machine: {f['test']}: {f['reason']}")
    if report["ok"]:
        print("device check: every step passed")
        return 0
    bad = [s["name"] for s in ran if not s["ok"]]
    print(f"device check FAILED: {', '.join(bad) or 'no step ran'} (see their logs in {out})")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
