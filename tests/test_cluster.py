"""ciuic on a real Ceph cluster (tests/cluster.py: 1 monitor, 3 OSDs, pools of 3 replicas with
min_size 2, radosgw for S3), started once for the module: the store contract, the conditional
commit and a race of two writer processes, the S3 dialect, and storage nodes failing under a
training job (slow). Skipped, with the reason, where Ceph is not installed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ciuic import knobs
from ciuic.errors import StoreAccessError, StoreError
from ciuic.store import Store, open_store
from ciuic.store.conformance import StoreConformance
from ciuic.store.retry import RetryingStore
from ciuic.store.s3 import S3Store
from tests import cluster
from tests.cluster import Cluster

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ceph() -> Iterator[Cluster]:
    with cluster.running(or_skip=True) as cl, pytest.MonkeyPatch.context() as mp:
        for k, v in cl.env.items():
            mp.setenv(k, v)
        yield cl


@pytest.fixture
def ceph_url(ceph: Cluster) -> str:
    return ceph.url(ceph.make_bucket())


@pytest.fixture
def healed(ceph: Cluster) -> Iterator[Cluster]:
    """The cluster, with every OSD started again and every placement group clean afterwards."""
    try:
        yield ceph
    finally:
        for i in ceph.down():
            ceph.start_osd(i)
        ceph.wait_clean()


def test_the_cluster_printout_names_each_daemons_pid_and_how_to_stop_and_start_an_osd(
        ) -> None:
    """``python -m tests.cluster`` prints every daemon's PID and the commands that stop an OSD
    as a crash would and start it again (no cluster needed: the printout's function)."""
    pids = {"mon.a": 101, "mgr.x": 102, "osd.0": 103, "osd.1": 104, "osd.2": 105, "rgw": 106}
    text = cluster.describe("http://127.0.0.1:8000", Path("/tmp/c/ceph.conf"), pids)
    for name, pid in pids.items():
        assert re.search(rf"^  {re.escape(name)} +pid {pid}$", text, re.M), text
    assert "kill -9 105" in text and "ceph-osd -f -c /tmp/c/ceph.conf -i 2" in text
    assert "http://127.0.0.1:8000" in text and cluster.ACCESS_KEY in text


class TestCephStore(StoreConformance):
    @pytest.fixture
    def store(self, ceph_url: str) -> Iterator[Store]:
        with open_store(ceph_url) as s:
            yield s


# -- the commit ------------------------------------------------------------------------------

RACER = """
import sys, time
from ciuic.store import open_store
url, me, start, n = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
s = open_store(url)
assert s._supports_conditional(), "no conditional PUT"
time.sleep(max(0.0, start - time.time()))
for i in range(n):
    print(i, s.create(f"jobs/p/j/manifests/{i:03d}.json", f"writer {me}".encode()), flush=True)
"""


def test_two_writer_processes_racing_for_one_job_never_both_commit(ceph_url: str) -> None:
    """Two processes, each its own connections, create the same 40 manifests at the same
    instant: each manifest has exactly one creator, and holds that creator's bytes."""
    s = open_store(ceph_url)
    assert isinstance(s, S3Store) and s.conditional == "auto"
    assert s._supports_conditional() is True  # radosgw honours If-None-Match: * (412)
    n, start = 40, time.time() + 4
    procs = [subprocess.Popen([sys.executable, "-c", RACER, ceph_url, me, str(start), str(n)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for me in ("a", "b")]
    outs = {me: p.communicate(timeout=120) for me, p in zip("ab", procs, strict=True)}
    assert all(p.returncode == 0 for p in procs), outs
    won = {me: {int(line.split()[0]) for line in out.splitlines() if line.endswith("True")}
           for me, (out, _) in outs.items()}
    assert won["a"].isdisjoint(won["b"]) and won["a"] | won["b"] == set(range(n)), won
    for i in range(n):
        winner = "a" if i in won["a"] else "b"
        assert s.get(f"jobs/p/j/manifests/{i:03d}.json") == f"writer {winner}".encode()


# -- the dialect -----------------------------------------------------------------------------

def test_a_part_size_below_s3s_minimum_is_raised_to_it(ceph_url: str) -> None:
    """radosgw refuses to complete a multipart upload whose parts are under 5 MiB
    (EntityTooSmall), as AWS does: a part knob below that failed every large upload. A 1 MiB
    knob is raised to 5 MiB."""
    blob = os.urandom(11 << 20)
    with knobs.override(s3_multipart_threshold_bytes=1 << 20, s3_part_bytes=1 << 20):
        s = open_store(ceph_url)
        s.put("big/one", blob)
        assert s.get("big/one") == blob
        assert s.create("big/two", blob) is True and s.create("big/two", b"x") is False
    assert isinstance(s, S3Store)
    head = s._client.head_object(Bucket=s.bucket, Key="ciuic/big/one")
    assert head["ETag"].strip('"').endswith("-3")  # 5 + 5 + 1 MiB


def test_listing_beyond_one_page_is_whole_and_sorted(ceph_url: str) -> None:
    """radosgw answers at most 1,000 keys a page, as AWS does."""
    s = open_store(ceph_url)
    keys = [f"chunks/{i % 7:02x}/{i:05d}" for i in range(1100)]
    s.put_many([(k, b"") for k in keys])
    assert list(s.list("chunks/")) == sorted(keys)
    assert s.children("chunks/") == [f"{i:02x}" for i in range(7)]


def test_bad_credentials_are_still_a_credentials_error(ceph: Cluster, ceph_url: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A healthy cluster's refusal comes at once and is what it says."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    s = RetryingStore(open_store(ceph_url), attempts=3, backoff_s=5)
    with pytest.raises(StoreAccessError, match=r"SignatureDoesNotMatch|refused"):
        s.put("k", b"1")  # not retried: three attempts with 5 s backoff would take 15 s


@pytest.mark.slow  # 25 s
def test_a_throttling_gateway_slows_snapshots_but_fails_none(ceph: Cluster) -> None:
    """A radosgw that serves one request at a time (rgw_max_concurrent_requests 1) answers the
    rest 503 SlowDown. ciuic's parallel writes back off and slow down (botocore's adaptive
    mode, 5 attempts) and both snapshots commit; with the standard mode's 3 attempts the first
    failed."""
    import torch

    from ciuic import SnapshotManager, StateHolder

    endpoint = ceph.start_gateway("throttled", rgw_max_concurrent_requests="1")
    bucket = ceph.make_bucket()
    import boto3
    from botocore.config import Config

    once = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        config=Config(retries={"mode": "standard", "max_attempts": 1}))
    codes: list[str] = []

    def put(i: int) -> None:
        try:
            once.put_object(Bucket=bucket, Key=f"raw/{i}", Body=os.urandom(1 << 20))
            codes.append("ok")
        except Exception as e:  # the answer is what is collected
            codes.append(str(getattr(e, "response", {}).get("Error", {}).get("Code")))

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, range(32)))
    assert "SlowDown" in codes, codes  # the gateway does throttle
    url = f"s3://{bucket}/ciuic?endpoint={endpoint}"
    g = torch.Generator().manual_seed(0)
    for step in (1, 2):
        state = {f"t{i}": torch.randn(256 * 1024, generator=g) for i in range(32)}  # 32 MiB
        with SnapshotManager("p", job="j", store=url, asynchronous=False,
                             handle_signals=False, compression="off") as m:
            m.save(step, state=StateHolder(state))
        back = StateHolder()
        with SnapshotManager("p", job="j", store=url, handle_signals=False) as m:
            assert m.restore(state=back) == step
        assert all(torch.equal(back.state[k], v) for k, v in state.items())


# -- storage nodes fail ----------------------------------------------------------------------

def _train(url: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tests.cluster_train", "--store", url, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={k: v for k, v in os.environ.items() if k != "CIUIC_HOME"})


def _wait_for(proc: subprocess.Popen[str], pattern: str, seen: list[str],
              timeout: float = 240) -> None:
    """Read the job's standard output into ``seen`` until a line matches ``pattern``."""
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"the job ended before {pattern!r}: {proc.wait()} "
                                 f"{proc.stderr.read() if proc.stderr else ''}")
        seen.append(line.rstrip("\n"))
        if re.fullmatch(pattern, seen[-1]):
            return
    raise AssertionError(f"no {pattern!r} within {timeout:g} s")


def _states(lines: list[str]) -> dict[int, str]:
    return {int(s): d for _, s, d in (ln.split() for ln in lines if ln.startswith("STATE "))}


def _restores_bit_exact(url: str, states: dict[int, str]) -> list[int]:
    """Restore every committed snapshot of the job into a fresh model; compare each with the
    state the job had at its step. Returns the committed steps."""
    from ciuic import ResumableSampler, SnapshotManager
    from ciuic.chain.repo import Repository
    from tests.helpers.train_mlp import build, digest_state

    repo = Repository.open(url)
    steps = sorted(repo.read_manifest("tests", "mlp", sid).step
                   for sid in repo.manifest_ids("tests", "mlp"))
    repo.close()
    assert steps and set(steps) <= set(states), (steps, sorted(states))
    for step in steps:
        model, optimizer, scheduler, _, dataset = build(seed=99)
        with SnapshotManager("tests", job="restorer", store=url, handle_signals=False) as m:
            assert m.restore(model, optimizer, scheduler=scheduler,
                             sampler=ResumableSampler(dataset), snapshot=f"mlp@{step}") == step
        assert digest_state(model, optimizer) == states[step], f"step {step} differs"
    return steps


def _verify_deep(url: str) -> str:
    run = subprocess.run([sys.executable, "-m", "ciuic", "--store", url, "verify", "--deep"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


@pytest.mark.slow
def test_training_goes_on_while_a_storage_node_is_killed_and_brought_back(
        healed: Cluster, ceph_url: str, reference_digest: str) -> None:
    """Snapshots every 2 steps; OSD 2 killed (SIGKILL) at step 8 and started again at step 24:
    the job ends with the uninterrupted job's state, every committed snapshot restores bit for
    bit (also with another OSD down), `ciuic verify --deep` passes."""
    seen: list[str] = []
    job = _train(ceph_url, "--sleep", "0.3")
    _wait_for(job, "STEP 8", seen)
    healed.kill_osd(2)
    _wait_for(job, "STEP 24", seen)
    healed.start_osd(2)
    out, err = job.communicate(timeout=300)
    seen += out.splitlines()
    assert job.returncode == 0, err
    assert f"DIGEST {reference_digest}" in seen
    assert "failed" not in err, err  # one node down: no snapshot failed
    healed.wait_clean()
    healed.kill_osd(0)  # restore with one node down
    steps = _restores_bit_exact(ceph_url, _states(seen))
    assert len(steps) >= 15 and max(steps) == 39, steps
    resumed = _train(ceph_url, "--steps", "44")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0 and "START 40" in out.splitlines(), err
    checked = re.search(r"tests/mlp: (\d+) snapshots checked, .* re-hashed: ok", _verify_deep(
        ceph_url))
    assert checked and int(checked[1]) == len(steps) + 3, checked  # and 40, 42, 43


@pytest.mark.slow
@pytest.mark.long  # radosgw's answers below min_size: their mapping in test_cluster_dialect
def test_with_too_few_nodes_a_snapshot_fails_clearly_and_training_goes_on(
        healed: Cluster, ceph_url: str) -> None:
    """Two of three OSDs killed: the pools are below min_size. radosgw answers after `rados osd
    op timeout` with 403 InvalidAccessKeyId, 400, 403/408 (HEAD) or 405 (GET): the snapshot
    fails within the retry bounds with a message that names the store and the real cause,
    training goes on, and once the OSDs are back the next snapshot commits. Meanwhile, this
    process's own calls get the same explanation: a store whose credentials were accepted
    before, and a fresh one, which is told so from how long the answer took."""
    s = open_store(ceph_url)
    s.put("k", b"1")
    seen: list[str] = []
    stop = Path(healed.base) / f"stop-{os.getpid()}"
    job = _train(ceph_url, "--sleep", "0.2", "--steps", "100000", "--until", str(stop),
                 "--on-busy", "skip", "--attempts", "2", "--timeout", "60", "--save-every", "10")
    _wait_for(job, "STEP 21", seen)
    healed.kill_osd(1)
    healed.kill_osd(2)
    killed_at = int(seen[-1].split()[1])
    assert job.stderr is not None
    failure = ""
    deadline = time.monotonic() + 400
    while not failure and time.monotonic() < deadline:
        line = job.stderr.readline()
        assert line, "the job ended"
        if "snapshot at step" in line and "failed" in line:
            failure = line
    assert failure, "no snapshot failed"
    assert "s3://" in failure and "min_size" in failure and "ceph health" in failure, failure

    def error(call: Callable[[], object]) -> BaseException | None:
        try:
            call()
        except BaseException as e:  # what it raised is checked below
            return e
        return None

    calls = (lambda: s.get("k"), lambda: s.has("k"), lambda: s.put("k2", b"2"),
             lambda: open_store(ceph_url).get("k"))
    with ThreadPoolExecutor(len(calls)) as pool:  # each waits the op timeout: together
        errors = list(pool.map(error, calls))
    for err in errors:
        assert isinstance(err, StoreError) and not isinstance(err, StoreAccessError), err
        assert "min_size" in str(err) and "ceph health detail" in str(err), err
        assert "403" not in str(err) or "credentials are not the cause" in str(err)
    healed.start_osd(1)
    healed.start_osd(2)
    time.sleep(8)  # a few snapshots' worth of steps with every OSD back
    stop.touch()
    out, err = job.communicate(timeout=300)
    seen += out.splitlines()
    assert job.returncode == 0, err
    steps_run = [int(ln.split()[1]) for ln in seen if ln.startswith("STEP ")]
    assert max(steps_run) > killed_at + 20  # trained on through the outage
    steps = _restores_bit_exact(ceph_url, _states(seen))
    assert max(steps) == max(steps_run) and any(x > killed_at for x in steps), steps


@pytest.mark.slow
@pytest.mark.long  # a cluster set up without the op timeout the docs require
def test_without_the_op_timeout_a_held_request_is_bounded_and_explained(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster configured without `rados osd op timeout`, two of its three OSDs killed:
    radosgw holds a GET until they return. ciuic's read timeout ends it, within the store's
    bounds, and the error says what a Ceph cluster below min_size does and which setting to
    set."""
    with cluster.running(bounded=False, or_skip=True) as cl:
        for k, v in cl.env.items():
            monkeypatch.setenv(k, v)
        url = cl.url(cl.make_bucket())
        open_store(url).put("k", b"1")
        cl.kill_osd(1)
        cl.kill_osd(2)
        with knobs.override(s3_read_timeout_s=3.0):
            held = RetryingStore(open_store(url), attempts=1, timeout_s=100)
            with pytest.raises(StoreError) as e:
                held.get("k")
        assert "Read timeout" in str(e.value) and "rados osd op timeout" in str(e.value)
        assert "did not finish in" not in str(e.value)  # botocore's bound, not the last resort

