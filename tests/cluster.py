"""Start a real Ceph cluster on 127.0.0.1 for the tests: one monitor, three (or more) OSDs
(BlueStore on sparse files), one radosgw speaking S3; every pool 3 replicas, ``min_size`` 2.

From Debian's packages (``ceph-mon``, ``ceph-osd``, ``radosgw``, ``ceph-common``: installed by
scripts/services.sh). No systemd, no cephadm, no containers: each daemon is a child process
(``-f``) in a fresh directory, with authentication off (``auth ... = none``) on loopback. A
test can kill an OSD (SIGKILL, as a crashed node) and start it again; :meth:`Cluster.close`
stops everything and removes the directory.

The settings that keep a request from hanging when too few OSDs are left are the ones
docs/storage.md tells users to set (:data:`BOUNDED`): without them an I/O to a placement group
below ``min_size`` waits until the OSDs come back, however long that is.

    python -m tests.cluster      # start one, print its endpoint, its daemons' PIDs and how to
                                 # stop and restart an OSD by hand; wait for Ctrl-C
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.s3server import free_port

BINARIES = ("ceph-mon", "ceph-mgr", "ceph-osd", "radosgw", "radosgw-admin", "monmaptool",
            "ceph-authtool", "ceph")
ACCESS_KEY = "ciuic-cluster"
SECRET_KEY = "ciuic-cluster-secret-0123456789"

#: what bounds a request to a placement group below min_size (seconds), in the monitor's, the
#: OSDs' and radosgw's configuration: the same values docs/storage.md gives users
BOUNDED = {
    "rados osd op timeout": "5",
    "rados mon op timeout": "5",
    "rgw op thread timeout": "60",
}

#: how fast a killed OSD is noticed: peers ping each second and report it down after 4 s
FAST_FAILURE = {
    "osd heartbeat interval": "1",
    "osd heartbeat grace": "4",
    "mon osd min down reporters": "1",
    "mon osd down out interval": "3600",  # never re-replicate to the survivors here
    "osd mon heartbeat interval": "5",
}

SMALL = {
    "osd memory target": str(512 << 20),
    "osd memory cache min": str(64 << 20),
    "bluestore cache autotune": "false",
    "bluestore cache size": str(64 << 20),
    "bluestore block create": "true",
    "bluestore fsck on mount": "false",
    "osd op num shards": "1",
    "osd op num threads per shard": "2",
    "rgw thread pool size": "64",
    "rgw gc obj min wait": "10",  # deleted objects' space back soon (the benchmark's rounds)
    "rgw gc processor period": "10",
}


class ClusterUnavailable(RuntimeError):
    """Ceph cannot start here: the reason, for a skip."""


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


@dataclass
class Cluster:
    base: Path
    conf: Path
    endpoint: str
    osds: int
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    started_s: float = 0.0

    @property
    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_DEFAULT_REGION": "us-east-1"}

    def url(self, bucket: str, prefix: str = "ciuic") -> str:
        return f"s3://{bucket}/{prefix}?endpoint={self.endpoint}"

    def client(self) -> object:
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                            config=Config(retries={"mode": "standard", "max_attempts": 3}))

    def make_bucket(self) -> str:
        name = f"ciuic-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)  # type: ignore[attr-defined]
        return name

    # -- the daemons -----------------------------------------------------------------------

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = (self.base / f"{name}.out").open("ab")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, preexec_fn=die_with_parent)

    def ceph(self, *args: str, timeout: float = 30) -> str:
        run = subprocess.run(["ceph", "-c", str(self.conf), "--connect-timeout", "10", *args],
                             capture_output=True, text=True, timeout=timeout)
        if run.returncode != 0:
            raise RuntimeError(f"ceph {' '.join(args)} failed: {run.stderr.strip()[-2000:]}")
        return run.stdout

    def start_gateway(self, name: str, **options: str) -> str:
        """Start another radosgw on the same cluster with ``options`` (``rgw_...`` settings);
        return its endpoint. Stopped with the cluster."""
        port = free_port()
        extra = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
        self._spawn(f"rgw.{name}", ["radosgw", "-f", "-c", str(self.conf), "-n",
                                    f"client.rgw.{name}", f"--rgw-frontends=beast "
                                    f"endpoint=127.0.0.1:{port}", *extra])
        endpoint = f"http://127.0.0.1:{port}"
        _wait_http(self, endpoint, 60, f"rgw.{name}")
        return endpoint

    def kill_osd(self, i: int) -> None:
        """SIGKILL OSD ``i`` (a crashed storage node) and wait until the monitor marks it down."""
        proc = self.procs.pop(f"osd.{i}")
        proc.kill()
        proc.wait()
        self.wait_osds_up(self.osds - len(self.down()))

    def down(self) -> list[int]:
        return [i for i in range(self.osds) if f"osd.{i}" not in self.procs]

    def start_osd(self, i: int) -> None:
        """Start OSD ``i`` again (its data is on its file) and wait until it is up."""
        self._spawn(f"osd.{i}", ["ceph-osd", "-f", "-c", str(self.conf), "-i", str(i)])
        self.wait_osds_up(self.osds - len(self.down()))

    def wait_osds_up(self, n: int, timeout: float = 90) -> None:
        import json

        deadline = time.monotonic() + timeout
        while True:
            stat = json.loads(self.ceph("osd", "stat", "-f", "json"))
            if int(stat.get("num_up_osds", -1)) == n:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"waited {timeout:g} s for {n} OSDs up, have {stat}")
            time.sleep(0.5)

    def wait_clean(self, timeout: float = 120) -> None:
        """Wait until every placement group is active+clean (recovery done after a restart)."""
        import json

        deadline = time.monotonic() + timeout
        while True:
            states = json.loads(self.ceph("pg", "dump", "pgs_brief", "-f", "json"))
            rows = states.get("pg_stats", states) if isinstance(states, dict) else states
            if rows and all(r.get("state") == "active+clean" for r in rows):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"placement groups not clean after {timeout:g} s")
            time.sleep(1)

    def rss_bytes(self) -> int:
        """The resident memory of every daemon together."""
        total = 0
        for proc in self.procs.values():
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        return total

    def cpu_s(self) -> float:
        """The CPU time (user and system) every running daemon has used, in seconds."""
        total = 0
        for proc in self.procs.values():
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{proc.pid}/stat").read_text().rpartition(")")[2].split()
                total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
        return total / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        stop_daemons(self.procs)
        shutil.rmtree(self.base, ignore_errors=True)


def stop_daemons(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    """SIGTERM to every daemon, SIGKILL to one that has not exited 10 s later; ``procs``
    emptied."""
    for proc in procs.values():
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
    for proc in procs.values():
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    procs.clear()


def die_with_parent() -> None:
    """In the child: SIGKILL it when the process that started it dies (a test run killed
    leaves no daemons behind)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _conf(base: Path, fsid: str, mon: str, rgw_port: int, block_bytes: int,
          bounded: bool) -> str:
    settings = {
        "bluestore block size": str(block_bytes),  # sparse: only what is written takes space
        "fsid": fsid,
        "mon host": mon,
        "auth cluster required": "none",
        "auth service required": "none",
        "auth client required": "none",
        "auth supported": "none",
        "ms mon client mode": "secure crc",  # radosgw under auth none needs it
        "ms bind ipv4": "true",
        "public network": "127.0.0.0/8",
        "keyring": str(base / "keyring"),
        "run dir": str(base / "run"),
        "admin socket": str(base / "run" / "$name.asok"),
        "log file": str(base / "log" / "$name.log"),
        "mon data": str(base / "$name"),
        "mgr data": str(base / "$name"),
        "osd data": str(base / "$name"),
        "osd objectstore": "bluestore",
        "osd pool default size": "3",
        "osd pool default min size": "2",
        "osd pool default pg num": "8",
        "osd pool default pgp num": "8",
        "osd pool default pg autoscale mode": "off",
        "osd crush chooseleaf type": "0",  # one host: the replicas go to distinct OSDs
        "mon allow pool delete": "true",
        "mon allow pool size one": "false",
        "mon warn on pool no redundancy": "false",
        "mon data avail warn": "1",
        "mon data avail crit": "0",
        "debug ms": "0",
        "rgw dns name": "127.0.0.1",
        "rgw frontends": f"beast endpoint=127.0.0.1:{rgw_port}",
        **(BOUNDED if bounded else {}), **FAST_FAILURE, **SMALL,
    }
    return "[global]\n" + "".join(f"{k} = {v}\n" for k, v in settings.items())


def start(osds: int = 3, base: Path | None = None, block_bytes: int = 4 << 30,
          bounded: bool = True) -> Cluster:
    """Start a cluster of ``osds`` OSDs, each on a sparse file of ``block_bytes`` (without the
    :data:`BOUNDED` settings if not ``bounded``: what a cluster configured without them does);
    raise :class:`ClusterUnavailable` where Ceph is not installed (run scripts/services.sh as
    root)."""
    lacking = missing_binaries()
    if lacking:
        raise ClusterUnavailable(
            f"Ceph is not installed ({', '.join(lacking)} missing): run scripts/services.sh as "
            "root, or install Debian's ceph-mon, ceph-osd, radosgw and ceph-common")
    t0 = time.monotonic()
    base = base or Path(tempfile.mkdtemp(prefix="ciuic-ceph-"))
    for d in ("run", "log"):
        (base / d).mkdir(parents=True, exist_ok=True)
    fsid = str(uuid.uuid4())
    mon_port, rgw_port = free_port(), free_port()
    mon = f"v2:127.0.0.1:{mon_port}"
    conf = base / "ceph.conf"
    conf.write_text(_conf(base, fsid, mon, rgw_port, block_bytes, bounded))
    cluster = Cluster(base, conf, f"http://127.0.0.1:{rgw_port}", osds)
    try:
        _bootstrap(cluster, fsid, mon)
        cluster.started_s = time.monotonic() - t0
    except BaseException:
        logs = "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                       for p in sorted(base.glob("*.out")))
        cluster.close()
        if isinstance(logs, str) and logs:
            raise RuntimeError(f"the Ceph cluster did not start:{logs}") from None
        raise
    return cluster


def _run(*cmd: str) -> None:
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {run.stderr.strip()[-2000:]}")


def _bootstrap(c: Cluster, fsid: str, mon: str) -> None:
    base, conf = c.base, str(c.conf)
    _run("ceph-authtool", "--create-keyring", str(base / "keyring"), "--gen-key", "-n", "mon.",
         "--cap", "mon", "allow *")
    _run("monmaptool", "--create", "--addv", "a", f"[{mon}]", "--fsid", fsid,
         str(base / "monmap"))
    _run("ceph-mon", "-c", conf, "--mkfs", "-i", "a", "--monmap", str(base / "monmap"),
         "--keyring", str(base / "keyring"))
    c._spawn("mon.a", ["ceph-mon", "-f", "-c", conf, "-i", "a"])
    (base / "mgr.x").mkdir()
    c._spawn("mgr.x", ["ceph-mgr", "-f", "-c", conf, "-i", "x"])
    for i in range(c.osds):
        osd_uuid = str(uuid.uuid4())
        assert c.ceph("osd", "new", osd_uuid).strip() == str(i)
        (base / f"osd.{i}").mkdir()
        _run("ceph-osd", "-c", conf, "-i", str(i), "--mkfs", "--osd-uuid", osd_uuid)
    for i in range(c.osds):
        c._spawn(f"osd.{i}", ["ceph-osd", "-f", "-c", conf, "-i", str(i)])
    c.wait_osds_up(c.osds)
    c._spawn("rgw", ["radosgw", "-f", "-c", conf, "-n", "client.rgw"])
    _wait_http(c, c.endpoint, 120)
    _run("radosgw-admin", "-c", conf, "user", "create", "--uid", "ciuic", "--display-name",
         "ciuic tests", "--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY)


def _wait_http(c: Cluster, url: str, timeout: float, name: str = "rgw") -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except urllib.error.HTTPError:
            return  # it answers (403 to an anonymous listing)
        except OSError:
            rgw = c.procs[name]
            if rgw.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"radosgw did not answer at {url}") from None
            time.sleep(0.3)


@contextlib.contextmanager
def running(osds: int = 3, block_bytes: int = 4 << 30, bounded: bool = True,
            or_skip: bool = False) -> Iterator[Cluster]:
    """A cluster for the block, closed after it. ``or_skip``: in a test, skip it with the
    reason where Ceph cannot start (:class:`ClusterUnavailable`)."""
    try:
        cluster = start(osds, block_bytes=block_bytes, bounded=bounded)
    except ClusterUnavailable as e:
        if not or_skip:
            raise
        import pytest

        pytest.skip(str(e))
    try:
        yield cluster
    finally:
        cluster.close()


def describe(endpoint: str, conf: Path, pids: dict[str, int]) -> str:
    """What ``python -m tests.cluster`` prints: the endpoint, the credentials, each daemon's
    PID, and how to stop an OSD (a crashed storage node) and start it again by hand."""
    lines = [f"endpoint {endpoint}  conf {conf}",
             f"AWS_ACCESS_KEY_ID={ACCESS_KEY} AWS_SECRET_ACCESS_KEY={SECRET_KEY}", "daemons:"]
    lines += [f"  {name:12} pid {pid}" for name, pid in sorted(pids.items())]
    osds = sorted(int(n.split(".")[1]) for n in pids if n.startswith("osd."))
    if osds:
        i = osds[-1]
        lines += [
            f"stop OSD {i} (a crashed storage node): kill -9 {pids[f'osd.{i}']}",
            f"start it again (its data is kept): ceph-osd -f -c {conf} -i {i} &",
            f"the cluster's view: ceph -c {conf} osd tree; ceph -c {conf} health detail",
            f"two of {len(osds)} OSDs stopped: the pools are below min_size (docs/storage.md)",
            "(an OSD started by hand is not stopped with the cluster: kill it before Ctrl-C)"]
    return "\n".join(lines)


if __name__ == "__main__":
    with running() as cl:
        print(f"up in {cl.started_s:.1f} s, {cl.rss_bytes() / 2**20:.0f} MiB resident", flush=True)
        print(describe(cl.endpoint, cl.conf, {n: p.pid for n, p in cl.procs.items()}),
              flush=True)
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()

