"""S3 specifics beyond the conformance suite: multipart, ranged reads, the commit fallback,
errors. All against moto's standalone server over HTTP (see conftest.s3_endpoint)."""

from __future__ import annotations

import os
import threading

import pytest

from ciuic import knobs
from ciuic.errors import (
    ConfigurationError,
    InvalidKey,
    ObjectNotFound,
    StoreAccessError,
    StoreError,
)
from ciuic.store import open_store
from ciuic.store.retry import RetryingStore
from ciuic.store.s3 import S3Store
from tests.models import linear
from tests.s3server import client


def test_large_objects_use_multipart_and_parallel_ranged_reads(s3_url: str,
                                                               s3_endpoint: str) -> None:
    blob = os.urandom(5 * 1024 * 1024 + 12345)
    with knobs.override(s3_multipart_threshold_bytes=5 << 20, s3_part_bytes=5 << 20):
        s = open_store(s3_url)
        assert isinstance(s, S3Store)
        s.put("big/one", [blob[:100], memoryview(blob)[100:]])
        head = client(s3_endpoint).head_object(Bucket=s.bucket, Key="ciuic/big/one")
        assert head["ETag"].strip('"').endswith("-2"), "not a two-part multipart upload"
        assert s.get("big/one") == blob
        a = bytearray(3 << 20)
        b = bytearray(len(blob) - len(a))
        assert s.get_into("big/one", [memoryview(a), memoryview(b)]) == len(blob)
        assert bytes(a) + bytes(b) == blob
        assert s.create("big/one", blob) is False
        assert s.create("big/two", blob) is True
        assert s.get("big/two") == blob
        # a range across parts, from an offset: parallel ranged GETs of that range only
        c = bytearray(5 << 20)
        assert s.get_into("big/one", [memoryview(c)], 12345) == len(blob)
        assert bytes(c) == blob[12345:12345 + len(c)]
        tail = bytearray(b"\xff" * 100)
        assert s.get_into("big/one", [memoryview(tail)], len(blob) - 40) == len(blob)
        assert bytes(tail[:40]) == blob[-40:] and tail[40:] == b"\xff" * 60


def test_a_batch_of_small_objects_is_sent_and_asked_about_in_parallel(s3_url: str) -> None:
    """Each PUT and HEAD waits a round trip or two: a batch of a model's small chunks goes out
    in parallel requests, not one after another. Each request here waits at a barrier for a
    second one to be in flight (one at a time, the first would wait until the barrier breaks,
    and the batch would fail)."""
    s = open_store(s3_url)
    assert isinstance(s, S3Store)
    barriers = {"PutObject": threading.Barrier(2, timeout=20),
                "HeadObject": threading.Barrier(2, timeout=20)}
    met: list[str] = []

    def in_pairs(model: object, **_: object) -> None:
        name = str(getattr(model, "name", ""))
        if name in barriers:
            barriers[name].wait()
            met.append(name)

    s._client.meta.events.register("before-call.s3.PutObject", in_pairs)
    s._client.meta.events.register("before-call.s3.HeadObject", in_pairs)
    keys = [f"chunks/aa/{i}" for i in range(4)]
    s.put_many([(k, k.encode() * 100) for k in keys], durable=False)
    lacking = ["chunks/bb/0", "chunks/bb/1"]
    assert s.missing([keys[0], *lacking, keys[3]]) == lacking  # 4 HEADs, in the keys' order
    assert met.count("PutObject") == 4 and met.count("HeadObject") == 4
    s._client.meta.events.unregister("before-call.s3.PutObject", in_pairs)
    s._client.meta.events.unregister("before-call.s3.HeadObject", in_pairs)
    assert [s.get(k) for k in keys] == [k.encode() * 100 for k in keys]


def test_a_failed_object_fails_its_batch_after_the_others_are_written(s3_url: str) -> None:
    s = open_store(s3_url)
    with pytest.raises(InvalidKey):
        s.put_many([("ok/one", b"1"), ("../bad", b"2"), ("ok/two", b"3")])
    assert s.get("ok/one") == b"1" and s.get("ok/two") == b"3"  # none left running


def test_prefixes_isolate_stores_in_one_bucket(s3_url: str) -> None:
    a = open_store(s3_url)
    b = open_store(s3_url.replace("/ciuic?", "/other?"))
    a.put("k", b"a")
    assert not b.has("k")
    assert list(a.list()) == ["k"] and list(b.list()) == []
    assert a.location("k").endswith("/ciuic/k")


def test_conditional_fallback_still_has_one_winner_in_process(s3_url: str) -> None:
    s = open_store(s3_url + "&conditional=never")
    results: list[bool] = []
    barrier = threading.Barrier(6)

    def worker(i: int) -> None:
        barrier.wait()
        results.append(s.create("m/x", f"w{i}".encode()))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(True) == 1


def test_probe_detects_conditional_support_and_leaves_nothing(s3_url: str) -> None:
    s = open_store(s3_url)
    assert isinstance(s, S3Store)
    assert s._supports_conditional() is True
    assert list(s.list()) == []  # the probe object is gone


def test_missing_bucket_is_a_clear_permanent_error(s3_endpoint: str) -> None:
    s = RetryingStore(open_store(f"s3://no-such-bucket-ciuic/x?endpoint={s3_endpoint}"),
                      attempts=5, backoff_s=5)
    with pytest.raises(StoreAccessError, match="bucket 'no-such-bucket-ciuic' does not exist"):
        s.put("a", b"1")  # raised at once: five attempts with 5 s backoff would time out


def test_unreachable_endpoint_fails_with_the_endpoint_in_the_message() -> None:
    from tests.s3server import free_port

    with knobs.override(s3_connect_timeout_s=1.0):
        s = RetryingStore(open_store(f"s3://b/x?endpoint=http://127.0.0.1:{free_port()}"),
                          attempts=1)
        with pytest.raises(StoreError, match=r"127\.0\.0\.1") as e:
            s.get("k")
    assert not isinstance(e.value, ObjectNotFound)


@pytest.mark.parametrize("url, message", [
    ("s3:///prefix", "write s3://BUCKET"),
    ("s3://b/p?colour=blue", "unknown option"),
    ("s3://b/p?conditional=maybe", "conditional='maybe'"),
    ("s3://b/bad..//x", "invalid store key"),
])
def test_bad_urls_say_what_is_wrong(url: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        open_store(url)


def test_a_job_killed_while_saving_to_s3_resumes_bit_exact(s3_url: str,
                                                            reference_digest: str) -> None:
    import signal

    from tests.conftest import run_train

    assert run_train(s3_url, "--sync", "--kill-at", "13").rc == -signal.SIGKILL
    r = run_train(s3_url)
    assert r.rc == 0, r.err
    assert r.start == 11 and r.digest == reference_digest


def test_encrypted_snapshots_on_s3_hold_no_plaintext(s3_url: str, s3_endpoint: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from torch import nn

    from ciuic import SnapshotManager
    from ciuic.format.crypto import generate_key_text

    monkeypatch.setenv("CIUIC_ENCRYPTION_KEY", generate_key_text())
    model = linear(300, 200)
    with SnapshotManager("p", encryption=True, store=s3_url, handle_signals=False) as m:
        m.save(7, model)
    fresh = nn.Linear(300, 200)
    with SnapshotManager("p", store=s3_url, handle_signals=False) as m:
        assert m.restore(fresh) == 7
    assert torch.equal(fresh.weight, model.weight)
    c = client(s3_endpoint)
    bucket = s3_url.split("/")[2]
    needle = model.weight.detach()[3, :4].numpy().tobytes()
    seen = 0
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", []):
            body = c.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
            assert needle not in body and b"weight" not in body, obj["Key"]
            seen += 1
    assert seen >= 3  # chunks, body and manifest at least
