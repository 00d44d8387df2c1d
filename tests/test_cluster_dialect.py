"""What ciuic makes of the S3 dialects' answers (ciuic.store.s3dialect), decided from botocore's
own ClientError as boto3 raises it; the real cluster's answers are in tests/test_cluster.py
(slow). And the cluster fixture's reason to skip. Runs without a cluster."""

from __future__ import annotations

import pytest

from ciuic.errors import ObjectNotFound, StoreAccessError, StoreError
from ciuic.store import s3dialect


def _answer(status: int, code: str = "") -> Exception:
    from botocore.exceptions import ClientError

    error = {"Code": code or str(status), "Message": ""}
    return ClientError({"Error": error, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "PutObject")


def _translate(e: Exception, elapsed_s: float, accepted: bool) -> StoreError:
    return s3dialect.translate(e, what="writing", where="s3://b/p/k",
                               endpoint="http://rgw:7480", bucket="b", elapsed_s=elapsed_s,
                               accepted=accepted)


def test_a_prompt_refusal_of_new_credentials_is_a_credentials_error() -> None:
    err = _translate(_answer(403, "InvalidAccessKeyId"), 0.01, accepted=False)
    assert type(err) is StoreAccessError and "check the AWS credentials" in str(err)


@pytest.mark.parametrize("status, code, elapsed_s, accepted", [
    (403, "InvalidAccessKeyId", 0.02, True),   # the same keys worked a moment ago
    (403, "InvalidAccessKeyId", 20.0, False),  # a fresh client: the answer took 20 s
    (405, "MethodNotAllowed", 10.0, True),     # radosgw's GET
    (403, "", 30.0, False),                    # a HEAD: no body, no code
    (408, "", 6.0, False),
    (400, "", 12.0, True),                     # radosgw's bare 400 to a PUT
])
def test_radosgws_answers_below_min_size_name_the_cause(status: int, code: str,
                                                       elapsed_s: float, accepted: bool) -> None:
    err = _translate(_answer(status, code), elapsed_s, accepted)
    assert type(err) is StoreError, err  # transient: retried within bounds
    text = str(err)
    assert "s3://b/p/k" in text and "http://rgw:7480" in text and f"{elapsed_s:.1f} s" in text
    assert "min_size" in text and "ceph health detail" in text
    assert ("credentials are not the cause" in text) == (status == 403)


@pytest.mark.parametrize("code", ["SignatureDoesNotMatch", "AccessDenied"])
def test_a_named_refusal_stays_a_credentials_error_however_slow(code: str) -> None:
    """radosgw needs the user's records to say these: they are what they say."""
    assert type(_translate(_answer(403, code), 30.0, accepted=True)) is StoreAccessError


def test_a_prompt_bare_400_is_not_blamed_on_the_cluster() -> None:
    err = _translate(_answer(400), 0.05, accepted=True)
    assert type(err) is StoreError and "min_size" not in str(err) and "400" in str(err)


@pytest.mark.parametrize("status, code", [(503, "SlowDown"), (503, "ServiceUnavailable"),
                                          (500, "InternalError"), (502, "")])
def test_throttling_and_overload_are_transient_and_named(status: int, code: str) -> None:
    err = _translate(_answer(status, code), 4.0, accepted=True)
    assert type(err) is StoreError and "throttling or overloaded" in str(err)


def test_not_found_and_no_bucket() -> None:
    assert isinstance(_translate(_answer(404, "NoSuchKey"), 9.0, True), ObjectNotFound)
    err = _translate(_answer(404, "NoSuchBucket"), 0.01, False)
    assert type(err) is StoreAccessError and "bucket 'b' does not exist" in str(err)


@pytest.mark.parametrize("wanted, nbytes, expected", [
    (8 << 20, 1 << 30, 8 << 20),                 # the knob, when it fits
    (1 << 20, 11 << 20, 5 << 20),                # raised to S3's 5 MiB minimum
    (8 << 20, 200 << 30, -(-(200 << 30) // 10_000)),  # 200 GiB: at most 10,000 parts
])
def test_the_part_size_keeps_within_s3s_limits(wanted: int, nbytes: int, expected: int) -> None:
    part = s3dialect.part_bytes(wanted, nbytes)
    assert part == expected
    assert part >= 5 << 20 and -(-nbytes // part) <= 10_000


def test_a_read_timeout_says_what_a_ceph_cluster_does_without_an_op_timeout() -> None:
    from botocore.exceptions import ConnectTimeoutError, ReadTimeoutError

    text = s3dialect.hint(ReadTimeoutError(endpoint_url="http://rgw:7480/b/k"))
    assert "rados osd op timeout" in text and "min_size" in text
    assert s3dialect.hint(ConnectTimeoutError(endpoint_url="http://rgw:7480/b/k")) == ""


def test_without_ceph_the_cluster_tests_are_told_why(tmp_path: object,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Where Ceph is not installed, starting the cluster raises the reason the cluster tests
    skip with (and what to run), before anything is started."""
    from tests import cluster

    monkeypatch.setenv("PATH", str(tmp_path))  # no ceph-mon, radosgw, ... on it
    with pytest.raises(cluster.ClusterUnavailable, match=r"ceph-mon.*scripts/services\.sh"):
        cluster.start()
