"""The local channel between ``ciuic run`` and its workers (``supervisor/channel.py``,
``supervisor/holder.py``) serves this start's workers only, each for its own rank, and lends no
one a way to change another rank's bytes (issue #43, item 1). Each test is one of the issue's
attacks, made as an attacker would, against a real :class:`Holder` over its real socket."""

from __future__ import annotations

import errno
import json
import mmap
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ciuic.supervisor import messages
from ciuic.supervisor.channel import ENV, FDS_PER_MESSAGE, KEY_ENV, Link, receive, send
from ciuic.supervisor.holder import Holder
from ciuic.supervisor.messages import ProtocolError

SKEW = 16  # a buffer starts this far into its memfd
BYTES = b"A" * 4096


@pytest.fixture
def holder() -> Iterator[Holder]:
    h = Holder(budget=1 << 20)
    yield h
    h.close()


def _memfd(nbytes: int, data: bytes = b"", sealing: bool = True) -> int:
    fd = os.memfd_create("ciuic:test", os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if sealing else 0))
    os.ftruncate(fd, SKEW + nbytes)
    os.pwrite(fd, data, SKEW)
    return fd


def _put(link: Link, i: int, fd: int, nbytes: int) -> dict[str, Any]:
    try:
        return link.request({"op": "put", "id": i, "path": "w", "nbytes": nbytes}, [fd])[0]
    finally:
        os.close(fd)


def _staged(holder: Holder, rank: int = 0) -> Link:
    """Rank ``rank`` hands over one buffer of :data:`BYTES` and publishes it (snapshot "s")."""
    link = Link(holder.name, rank, holder.secret)
    assert _put(link, 1, _memfd(len(BYTES), BYTES), len(BYTES))["ok"]
    reply, _ = link.request({"op": "publish", "snapshot": "s", "step": 1, "ids": [1],
                             "leaves": [["w", 1, 0, len(BYTES)]],
                             "chunks": [["d", len(BYTES), 1, 0]]})
    assert reply["ok"], reply
    return link


def _held(holder: Holder, rank: int = 0) -> bytes:
    """What the holder keeps of rank ``rank``'s buffer 1."""
    return os.pread(holder._ranks[rank].buffers[1].fd, len(BYTES), SKEW)


def _raw(holder: Holder) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect("\0" + holder.name)
    return sock


def _ask(sock: socket.socket, message: dict[str, Any]) -> tuple[dict[str, Any] | None, int]:
    """The reply to ``message`` (None: the connection was closed) and how many descriptors
    came with it (closed)."""
    send(sock, message)
    reply, fds = receive(sock)
    for fd in fds:
        os.close(fd)
    return reply, len(fds)


# -- who may connect ---------------------------------------------------------------------------

ATTACKER = r"""
import json, mmap, os, socket, sys
out = []
for m in json.loads(sys.argv[2]):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect("\0" + sys.argv[1])
    said = {"fds": 0, "wrote": False}
    try:
        fds = []
        if m.get("op") == "put":
            fds = [os.memfd_create("x", 0)]
            os.ftruncate(fds[0], 4096)
        for x in m.pop("_before", []) + [m]:
            try:
                socket.send_fds(s, [json.dumps(x).encode()], fds if x is m else [])
            except OSError:  # closed: its answer may still be there to read
                pass
            data, got, _, _ = socket.recv_fds(s, 1 << 16, 10)
            said["reply"] = json.loads(data) if data else None
            said["fds"] += len(got)
            for fd in got:  # what an attacker does with a buffer it is handed
                try:
                    with mmap.mmap(fd, 32) as region:
                        region[16:24] = b"XXXXXXXX"
                        said["wrote"] = True
                except (OSError, ValueError):
                    pass
    except OSError as e:
        said["error"] = str(e)
    out.append(said)
print(json.dumps(out))
"""


def _python_for(user: str) -> str | None:
    """A Python interpreter that ``user`` may run (the test's own may lie in /root)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK) and subprocess.run(
                ["setpriv", "--reuid", user, "--regid", "nogroup", "--clear-groups", candidate,
                 "-c", "pass"], capture_output=True, timeout=30).returncode == 0:
            return candidate
    return None


def test_a_process_of_another_user_is_refused_before_it_can_do_anything(holder: Holder) -> None:
    """The issue's attack: run as ``nobody`` against a root ``ciuic run``, a script found the
    abstract socket in /proc/net/unix, read and overwrote a rank's staged bytes through the
    memfd it was handed, replaced the job's peer token and node list, and turned the tier off
    with one ``put`` of 1 PiB."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv, to run the attacker as nobody")
    python = _python_for("nobody")
    if python is None:
        pytest.skip("no Python interpreter that nobody may run")
    _staged(holder)
    with open("/proc/net/unix") as f:
        assert "@" + holder.name in f.read()  # anyone can see the name
    guess = {"op": "hello", "secret": "0" * 32, "rank": 1}
    attacks = [
        {"op": "fds", "ids": [1], "owner": 0, "rank": 1},  # the protocol before the fix
        {"op": "fds", "ids": [1], "owner": 0, "_before": [guess]},
        {"op": "peers", "token": "t" * 32, "me": 0, "rank": 0,
         "nodes": [[0, "192.0.2.1", 7000], [1, "192.0.2.2", 7000]]},
        {"op": "put", "id": 7, "path": "x", "nbytes": 1 << 50, "rank": 1},
    ]
    run = subprocess.run(["setpriv", "--reuid", "nobody", "--regid", "nogroup",
                          "--clear-groups", python, "-c", ATTACKER, holder.name,
                          json.dumps(attacks)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    said = json.loads(run.stdout)
    assert [s["fds"] for s in said] == [0, 0, 0, 0] and not any(s["wrote"] for s in said)
    for s in said:
        assert s.get("reply") is None or not s["reply"]["ok"], s
    assert "uid 65534" in said[0]["reply"]["why"], said
    assert _held(holder) == BYTES  # neither read nor written
    assert holder._token is None and holder._nodes == []  # no token or nodes taken
    assert holder.released is None and holder.copies()[0] == ("s", 1, len(BYTES))


def test_a_connection_without_this_starts_secret_is_refused(holder: Holder) -> None:
    _staged(holder)
    with _raw(holder) as sock:  # no hello: nothing, not even the heartbeat region
        reply, fds = _ask(sock, {"op": "attach", "pid": os.getpid()})
        assert reply is not None and not reply["ok"] and fds == 0
        assert KEY_ENV in reply["why"] and "secret" in reply["why"]
        assert receive(sock) == (None, [])  # and the connection is closed
    with _raw(holder) as sock:
        reply, fds = _ask(sock, {"op": "fds", "ids": [1], "owner": 0, "rank": 1})
        assert reply is not None and not reply["ok"] and fds == 0
    with pytest.raises(PermissionError, match="secret of this start"):
        Link(holder.name, 1, "f" * 32)
    with _raw(holder) as sock:  # a lone surrogate is no secret either (and breaks no thread)
        reply, fds = _ask(sock, {"op": "hello", "secret": "\ud800", "rank": 1})
        assert reply is not None and not reply["ok"] and fds == 0
    # a new start: its secret opens connections, the one before no longer does, and the
    # connections of the start before (its workers are gone) are closed
    old = holder.secret
    before = Link(holder.name, 0, old)
    env = holder.new_start()
    assert env == {ENV: holder.name, KEY_ENV: holder.secret} and holder.secret != old
    with pytest.raises((ConnectionError, OSError)):
        before.request({"op": "chunks"})
    with pytest.raises(PermissionError):
        Link(holder.name, 0, old)
    assert Link(holder.name, 0, holder.secret).request({"op": "chunks"})[0]["ok"]
    assert _held(holder) == BYTES and holder.copies()[0][0] == "s"


def test_a_connection_acts_only_for_the_rank_it_said_hello_as(holder: Holder) -> None:
    _staged(holder, rank=0)
    other = Link(holder.name, 1, holder.secret)
    for claim in ({"op": "invalidate", "rank": 0}, {"op": "free", "ids": [1], "rank": 0},
                  {"op": "fds", "ids": [1], "rank": 0}):
        reply, fds = other.request(claim)
        assert not reply["ok"] and fds == [], claim
        assert "protocol error" in reply["why"] and "'rank'" in reply["why"], reply
    # its own requests are its own rank's: rank 0's buffer is not among them
    reply, fds = other.request({"op": "fds", "ids": [1]})
    assert not reply["ok"] and fds == [] and reply["why"] == "unknown buffers"
    assert other.request({"op": "free", "ids": [1]})[0]["ok"]
    assert other.request({"op": "invalidate"})[0]["ok"]
    reply, _ = other.request({"op": "hello", "secret": holder.secret, "rank": 0})
    assert not reply["ok"] and "already said hello" in reply["why"]
    assert holder.copies()[0] == ("s", 1, len(BYTES)) and _held(holder) == BYTES


def test_another_ranks_buffers_are_lent_read_only(holder: Holder) -> None:
    owner = _staged(holder, rank=0)
    [fd] = Link(holder.name, 1, holder.secret).descriptors([1], owner=0)
    try:
        with pytest.raises(PermissionError):  # no writable shared mapping
            mmap.mmap(fd, SKEW + len(BYTES))
        with pytest.raises(OSError) as e:
            os.pwrite(fd, b"X" * 8, SKEW)
        assert e.value.errno == errno.EBADF
        with pytest.raises(OSError):
            os.ftruncate(fd, 0)
        # the memfd's mode says read-only too: a process of the job's user that is not root
        # cannot open it again for writing through /proc/self/fd
        assert os.fstat(fd).st_mode & 0o777 == 0o400
        with mmap.mmap(fd, SKEW + len(BYTES), prot=mmap.PROT_READ) as region:
            assert region[SKEW:] == BYTES  # the restore's read
    finally:
        os.close(fd)
    # its owner's restart maps its own buffers to write the next snapshot into them; it can
    # no longer resize them (a mapping past the end would fault in every reader)
    [own] = owner.descriptors([1])
    try:
        with mmap.mmap(own, SKEW + len(BYTES)) as region:
            region[SKEW:SKEW + 4] = b"BBBB"
        with pytest.raises(PermissionError):
            os.ftruncate(own, SKEW)
    finally:
        os.close(own)
    assert _held(holder)[:8] == b"BBBBAAAA"


def test_a_put_over_what_its_memfd_holds_is_refused_without_turning_the_tier_off(
        holder: Holder) -> None:
    link = Link(holder.name, 0, holder.secret)
    reply = _put(link, 1, _memfd(4096), 1 << 50)  # 1 PiB said, 4 KiB handed over
    assert not reply["ok"] and "put says 1125899906842624 bytes, and its memfd holds 4096" \
        in reply["why"], reply
    reply = _put(link, 1, _memfd(4096, sealing=False), 4096)
    assert not reply["ok"] and "MFD_ALLOW_SEALING" in reply["why"], reply
    read, write = os.pipe()
    os.close(write)
    reply = _put(link, 1, read, 4096)
    assert not reply["ok"] and "put takes a memfd" in reply["why"], reply
    reply, _ = link.request({"op": "fetch", "d": "d", "n": 1 << 50})  # nothing allocated
    assert not reply["ok"] and "'n' must be an integer in 1..1073741824" in reply["why"]
    assert holder.released is None and holder._ranks_held() == 0
    assert _put(link, 1, _memfd(4096), 4096)["ok"]  # the tier is on
    assert holder._ranks_held() == 4096


# -- what arrives ------------------------------------------------------------------------------

MALFORMED: list[tuple[bytes, str]] = [
    (b"[" * 50_000, "nested too deeply"),
    (b'{"op": ' * 9_000, "protocol error"),
    (b"\xff\xfe", "not JSON"),
    (b"not json", "not JSON"),
    (b"[1, 2]", "JSON object, not list"),
    (b'{"op": 3}', "unknown request 3"),
    (b'{"op": "put"}', "'id' is missing"),
    (b'{"op": "fds", "ids": "1"}', "'ids' must be a list"),
    (b'{"op": "fds", "ids": [true]}', "'ids'[0] must be an integer"),
    (b'{"op": "free", "ids": [-1]}', "must be an integer in 0.."),
    (b'{"op": "publish", "snapshot": "s", "step": 1, "ids": [], "leaves": [["p", 1]]}',
     "must be a list of 4"),
    (b'{"op": "peers", "token": "t", "me": 0, "nodes": [[0, "h", 70000]]}', "in 0..65535"),
    (b'{"op": "attach", "pid": 1, "x": {}}', "unexpected field 'x'"),
    (b'{"payload": 1000000}', "unknown request None"),  # no memfd with it
]


@pytest.mark.parametrize(("data", "why"), MALFORMED, ids=[w for _, w in MALFORMED])
def test_a_malformed_message_is_a_protocol_error_and_the_channel_goes_on(
        holder: Holder, data: bytes, why: str) -> None:
    link = Link(holder.name, 0, holder.secret)
    link._sock.send(data)
    reply, fds = receive(link._sock)
    assert reply is not None and not reply["ok"] and fds == []
    assert reply["why"].startswith("protocol error: ") and why in reply["why"], reply
    assert link.request({"op": "chunks"})[0]["ok"]  # the same connection still serves


def test_a_message_in_shared_memory_that_says_more_than_it_holds_is_refused(
        holder: Holder) -> None:
    link = Link(holder.name, 0, holder.secret)
    for n in (10**9, 1 << 40, -1, "x"):
        fd = _memfd(0)
        os.pwrite(fd, b'{"op": "chunks"}', 0)
        try:
            socket.send_fds(link._sock, [json.dumps({"payload": n}).encode()], [fd])
        finally:
            os.close(fd)
        reply, fds = receive(link._sock)
        assert reply is not None and not reply["ok"] and fds == []
        assert "a message in shared memory of" in reply["why"], reply
    assert link.request({"op": "chunks"})[0]["ok"]


def test_descriptors_that_come_with_a_refused_message_are_closed(holder: Holder) -> None:
    link = Link(holder.name, 0, holder.secret)
    null = os.open(os.devnull, os.O_RDONLY)
    before = len(os.listdir("/proc/self/fd"))
    cases: list[tuple[bytes, int, str]] = [
        (b'{"op": "chunks"}', 3, ""),  # only a put hands over a descriptor
        (b'{"op": "put", "id": 1, "nbytes": 8}', 2, "put takes one descriptor, not 2"),
        (b"[[[", 4, "not JSON"),
        (b'{"op": "chunks"}', 250, f"{FDS_PER_MESSAGE} descriptors"),
    ]
    for data, n, why in cases:
        socket.send_fds(link._sock, [data], [null] * n)
        reply, fds = receive(link._sock)
        assert reply is not None and fds == [] and why in reply.get("why", ""), reply
    assert len(os.listdir("/proc/self/fd")) == before  # the holder kept none of them
    os.close(null)
    assert link.request({"op": "chunks"})[0]["ok"]


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=5),
    max_leaves=20)
_OPS = [*sorted(messages._KINDS), "", "nope"]
_FIELDS = ["secret", "rank", "pid", "ids", "owner", "id", "path", "nbytes", "snapshot", "step",
           "leaves", "chunks", "token", "me", "nodes", "keys", "d", "n", "payload"]
#: messages that look like requests: a known op and fields of the protocol, with any values
_REQUESTS = st.builds(lambda op, fields: {"op": op, **fields}, st.sampled_from(_OPS),
                      st.dictionaries(st.sampled_from(_FIELDS), _JSON, max_size=5))


@settings(max_examples=200, deadline=None)
@given(st.one_of(_JSON, _REQUESTS))
def test_any_decoded_message_is_a_request_or_a_protocol_error(message: Any) -> None:
    try:
        request = messages.parse(message)
    except ProtocolError as e:
        assert str(e)
    else:
        assert isinstance(request, messages.Request)  # type: ignore[arg-type]


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(_REQUESTS, _JSON.map(lambda v: json.dumps(v).encode()),
                 st.binary(min_size=1, max_size=200)))
def test_the_holder_answers_any_message_and_goes_on_serving(holder: Holder,
                                                            message: Any) -> None:
    """Fuzzing the supervisor's end: whatever a worker sends, it gets an answer, and the
    connection still serves. (``listen`` and ``peers`` would start network services: those
    are checked by :func:`test_any_decoded_message_is_a_request_or_a_protocol_error`.)"""
    if isinstance(message, dict) and message["op"] in ("listen", "peers"):
        message["op"] = "chunks"
    link = Link(holder.name, 0, holder.secret)
    try:
        if isinstance(message, dict):
            send(link._sock, message)
        else:
            link._sock.send(message)
        reply, fds = receive(link._sock)
        for fd in fds:
            os.close(fd)
        assert isinstance(reply, dict) and isinstance(reply["ok"], bool), reply
        assert reply["ok"] or reply["why"]
        assert link.request({"op": "chunks"})[0]["ok"]
    finally:
        link.close()


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(_REQUESTS.map(lambda m: {**m, "op": "hello"}), _REQUESTS,
                 _JSON.map(lambda v: json.dumps(v).encode()), st.binary(min_size=1, max_size=200)))
def test_any_first_message_but_this_starts_hello_is_refused(holder: Holder,
                                                            message: Any) -> None:
    with _raw(holder) as sock:
        if isinstance(message, dict):
            send(sock, message)
        else:
            sock.send(message)
        reply, fds = receive(sock)
        assert fds == [] and isinstance(reply, dict) and reply["ok"] is False, reply
        assert reply["why"]
        assert receive(sock) == (None, [])  # closed
    assert Link(holder.name, 0, holder.secret).request({"op": "chunks"})[0]["ok"]
