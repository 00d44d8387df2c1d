"""``ciuic ls`` and ``ciuic log`` read an up-to-date catalog with sqlite3 (ciuic.chain.listing)
and repeat the SQL of the catalog's ORM (ciuic.catalog.Catalog): for any catalog, they return
exactly the rows the ORM's queries return (``Catalog.jobs``, ``snapshots``, ``runs``,
``events``). Checked on catalogs Hypothesis draws: several projects and jobs (a job name shared
by two projects), committed and pruned snapshots in several lineages, health verdicts, metrics
with NaN and infinities, runs with and without an end, events interleaved across jobs."""

from __future__ import annotations

import datetime as dt
import hashlib
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ciuic.catalog import Catalog
from ciuic.chain.listing import EVENTS, read_jobs, read_log
from ciuic.format import layout
from ciuic.format.manifest import HealthVerdict, Manifest
from ciuic.format.records import RunReport
from ciuic.store.local import LocalStore

PROJECTS = ("p", "q", "vision")
JOBS = ("a", "b", "train")
EPOCH = dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc)


def hexid(*parts: object) -> str:
    return hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()


def at(seconds: int) -> str:
    """A catalog timestamp; few distinct values, so that runs and snapshots share some."""
    return (EPOCH + dt.timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


times = st.integers(0, 40).map(at)
maybe_step = st.none() | st.integers(0, 10**12)
metric = (st.floats(allow_nan=True, allow_infinity=True) | st.integers(-10**9, 10**9)
          | st.booleans() | st.text(max_size=4))
metrics = st.dictionaries(st.sampled_from(["loss", "lr", "acc", "grad_norm", "note"]), metric,
                          max_size=4)
health = st.none() | st.fixed_dictionaries({
    "healthy": st.booleans(),
    "reasons": st.lists(st.sampled_from(["nan in loss", "loss spike", "inf in weights"]),
                        max_size=2),
    "nonfinite": st.integers(0, 3)}).map(HealthVerdict.from_json)


@st.composite
def snapshot(draw: st.DrawFn) -> dict[str, Any]:
    """A snapshot of a job: its parent is one of the job's other snapshots (an index) or none
    (a lineage's root); ``pruned``: never committed, or committed then pruned."""
    return {"step": draw(st.integers(0, 30)), "parent": draw(st.none() | st.integers(0, 7)),
            "created": draw(times), "body": draw(st.integers(0, 3)),
            "total_bytes": draw(st.integers(0, 2**40)), "new_bytes": draw(st.integers(0, 2**40)),
            "tensors": draw(st.integers(0, 500)), "world_size": draw(st.integers(1, 8)),
            "metrics": draw(metrics), "health": draw(health),
            "pruned": draw(st.sampled_from([None, "at once", "later"]))}


@st.composite
def run(draw: st.DrawFn) -> dict[str, Any]:
    ended = draw(st.none() | times)
    fields = {"started": draw(times), "host": draw(st.sampled_from(["gpu1", "gpu2"])),
              "pid": draw(st.integers(1, 2**22)), "last_step": draw(maybe_step),
              "last_seen": draw(times), "ended": ended,
              "end_kind": None if ended is None else draw(st.sampled_from(
                  ["clean", "exit:1", "exception:RuntimeError", "signal:SIGTERM"])),
              "cause": draw(st.none() | st.text(max_size=20)),
              "restart": draw(st.none() | st.integers(1, 5))}
    return {"fields": fields, "events": draw(st.lists(event(), max_size=3))}


def event() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({
        "at": times, "kind": st.sampled_from(["start", "snapshot", "end", "stopped", "note"]),
        "step": maybe_step, "detail": st.text(max_size=12)})


job = st.fixed_dictionaries({
    "snapshots": st.lists(snapshot(), max_size=8), "runs": st.lists(run(), max_size=3)})
catalogs = st.dictionaries(st.tuples(st.sampled_from(PROJECTS), st.sampled_from(JOBS)), job,
                           max_size=5)


def build(root: Path, jobs: dict[tuple[str, str], dict[str, Any]],
          extra_events: list[tuple[int, int, dict[str, Any]]]) -> None:
    """The store at ``root`` with its catalog as ``sync_job`` leaves it: a manifest for each
    row, a body for each committed one."""
    store = LocalStore(root / "objects")
    catalog = Catalog(f"sqlite:///{root / 'catalog.db'}")
    run_ids = {}
    try:
        for (project, name), spec in jobs.items():
            catalog.ensure_job(project, name)  # a job may have no snapshot
            ids = [hexid(project, name, i) for i in range(len(spec["snapshots"]))]
            for i, snap in enumerate(spec["snapshots"]):
                parent = snap["parent"]
                m = Manifest(project=project, job=name, step=snap["step"],
                             parent="" if parent is None or parent >= len(ids) else ids[parent],
                             created=snap["created"], body=hexid("body", project, name,
                                                                 snap["body"]),
                             body_bytes=100, total_bytes=snap["total_bytes"],
                             new_bytes=snap["new_bytes"], tensors=snap["tensors"],
                             world_size=snap["world_size"], metrics=snap["metrics"],
                             health=snap["health"])
                store.put(layout.manifest_key(project, name, ids[i]), m.encode())
                catalog.add_snapshot(m, ids[i], "pruned" if snap["pruned"] == "at once"
                                     else "committed")
                if snap["pruned"] == "later":
                    catalog.set_status(ids[i], "pruned")
                else:
                    store.put(layout.body_key(project, name, m.body), b"{}")
            for i, r in enumerate(spec["runs"]):
                run_id = run_ids[project, name, i] = hexid("run", project, name, i)[:16]
                catalog.record_run(project, name, run_id, RunReport.from_json(
                    run_id, {**r["fields"], "events": r["events"]}))
        names = list(jobs)
        for which, run_index, e in extra_events if names else []:  # interleaved across jobs
            project, name = names[which % len(names)]
            catalog.event(run_ids.get((project, name, run_index), "0" * 16), project, name,
                          e["kind"], e["step"], e["detail"])
    finally:
        catalog.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                               HealthCheck.function_scoped_fixture])
@given(jobs=catalogs, extra_events=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 2),
                                                      event()), max_size=8))
def test_ls_and_log_read_what_the_catalogs_orm_reads(
        jobs: dict[tuple[str, str], dict[str, Any]],
        extra_events: list[tuple[int, int, dict[str, Any]]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CIUIC_CATALOG", "CIUIC_MIRROR"):
        monkeypatch.delenv(name, raising=False)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build(root, jobs, extra_events)
        catalog = Catalog(f"sqlite:///{root / 'catalog.db'}")
        try:
            assert read_jobs(str(root)) == catalog.jobs()
            for project, name in jobs:
                log = read_log(str(root), f"{project}/{name}")
                assert log is not None
                assert (log.project, log.job) == (project, name)
                assert log.snapshots == catalog.snapshots(project, name, status=None,
                                                          newest_first=True)
                assert log.runs == catalog.runs(project, name)  # records: every field
                assert log.events == catalog.events(project, name, limit=EVENTS)
                bare = read_log(str(root), name)  # a job name unique across projects
                assert bare == (log if len(catalog.find_jobs(name)) == 1 else None)
        finally:
            catalog.close()
