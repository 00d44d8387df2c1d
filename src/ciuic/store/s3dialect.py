"""What S3-protocol servers answer differently, and what ciuic makes of it (docs/storage.md).

AWS S3, MinIO and Ceph's radosgw speak one protocol with different accents. This module holds
the accents ciuic handles, so that :mod:`ciuic.store.s3` stays about transfers:

- **Multipart limits**: at most 10,000 parts, each but the last at least 5 MiB (AWS, radosgw's
  ``rgw_multipart_min_part_size``, MinIO): :func:`part_bytes` picks a part size within them.
- **Error codes that do not say what happened**: Ceph's radosgw answers ``403
  InvalidAccessKeyId`` (PUT, listing), a bare ``400`` (PUT), ``403`` or ``408`` (HEAD) or
  ``405 MethodNotAllowed`` (GET)
  when it cannot read its own records in time, because the storage cluster under it has too few
  OSDs up for a pool's ``min_size`` (``rados osd op timeout`` bounds that wait; without it the
  request hangs until the OSDs return). The same credentials were accepted a moment before, and
  the answer comes after seconds, not milliseconds (any refusal that slow without a code of its
  own is taken for one of these; a named one such as ``SignatureDoesNotMatch`` or
  ``AccessDenied`` is what it says): :func:`translate` says so, and makes it a
  transient :class:`~ciuic.errors.StoreError` (retried within bounds) rather than a permanent
  :class:`~ciuic.errors.StoreAccessError`.
- **Throttling and overload**: ``503 SlowDown`` (AWS, radosgw's rate limits), ``503
  ServiceUnavailable``, ``500 InternalError``, ``RequestTimeout``: botocore's standard mode
  retries them with backoff, and what is left is a transient error that names the throttling.
"""

from __future__ import annotations

from typing import Any

from ciuic.errors import ObjectNotFound, StoreAccessError, StoreError

#: S3's limits on a multipart upload (AWS; radosgw and MinIO keep the same)
MAX_PARTS = 10_000
MIN_PART_BYTES = 5 << 20

NOT_FOUND = {"NoSuchKey", "404", "NotFound"}
ACCESS = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403",
          "AllAccessDisabled", "InvalidToken", "ExpiredToken", "AuthorizationHeaderMalformed"}
#: what radosgw answers when its storage cannot answer it in time
MISLEADING = {"InvalidAccessKeyId", "403", "MethodNotAllowed", "405"}
#: radosgw's answer to a HEAD (no body, so no code) that waited ``rados osd op timeout``
TIMED_OUT = {"408", "RequestTimeout"}
THROTTLED = {"SlowDown", "503", "ServiceUnavailable", "RequestTimeout",
             "InternalError", "500", "502", "504", "ServiceUnavailableException"}
#: a refusal that took this long was no authentication check: a server that waited on its
#: storage (radosgw's ``rados osd op timeout`` is 5 to 10 s in the settings docs/storage.md gives)
SLOW_ANSWER_S = 3.0


def part_bytes(wanted: int, nbytes: int) -> int:
    """The part size for a multipart upload of ``nbytes``: ``wanted`` (the knob), raised to
    S3's minimum and to what keeps the upload within :data:`MAX_PARTS` parts."""
    return max(wanted, MIN_PART_BYTES, -(-nbytes // MAX_PARTS))


def hint(e: Exception) -> str:
    """What to add to a transport error's message: a read that timed out on a Ceph cluster is
    most often radosgw holding the request while its pools are below min_size."""
    from botocore.exceptions import ReadTimeoutError

    if isinstance(e, ReadTimeoutError):
        return (" (the server accepted the request and did not answer: a Ceph radosgw whose "
                "pools are below min_size holds requests until enough OSDs return, unless its "
                "`rados osd op timeout` is set; see docs/storage.md)")
    return ""


def code(e: Exception) -> str:
    response = getattr(e, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def status(e: Exception) -> int | None:
    response: dict[str, Any] = getattr(e, "response", None) or {}
    value = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return int(value) if value is not None else None


def translate(e: Exception, *, what: str, where: str, endpoint: str, bucket: str,
              elapsed_s: float, accepted: bool) -> StoreError:
    """The ciuic error for a ClientError ``e`` answered to ``what`` of ``where``.

    ``accepted``: whether this store's credentials were accepted by the server before (any
    answer other than a refusal); ``elapsed_s``: how long the call took, botocore's retries
    included."""
    c = code(e)
    st = status(e)
    answer = f"{st} {c}" if st is not None and str(st) != c else c or str(e)
    if c in NOT_FOUND:
        return ObjectNotFound(f"{where} not found")
    if c == "NoSuchBucket":
        return StoreAccessError(
            f"bucket {bucket!r} does not exist at {endpoint}: create it (for example `aws s3 "
            f"mb s3://{bucket}`) or fix the store URL")
    slow = elapsed_s >= SLOW_ANSWER_S
    # a refusal with no code of its own (a HEAD's, or radosgw's bare 400); a named one such as
    # SignatureDoesNotMatch or AccessDenied needs the records radosgw could not read
    bare = st is not None and 400 <= st < 500 and (not c or c.isdigit())
    if (c in MISLEADING and accepted) or (slow and (c in MISLEADING or c in TIMED_OUT
                                                    or bare)):
        if c in ACCESS:
            why = (", although it accepted these credentials before" if accepted else
                   ", after waiting, where a real refusal comes at once")
            blame = "The credentials are not the cause"
        else:
            why, blame = "", "The request is not the cause"
        return StoreError(
            f"{what} {where} failed: {endpoint} answered {answer} after {elapsed_s:.1f} s{why}. "
            f"{blame}: Ceph's radosgw answers so when it cannot read its own records in time, "
            "because the storage cluster under it has too few OSDs up for a pool's min_size "
            "(or its monitors lost quorum). Check the cluster (`ceph health detail`, `ceph osd "
            "tree`); see docs/storage.md")
    if c in ACCESS:
        return StoreAccessError(
            f"{what} {where} was refused ({answer}): check the AWS credentials "
            "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE) and the bucket's policy")
    if c in THROTTLED or (st is not None and st >= 500):
        return StoreError(
            f"{what} {where} failed: {endpoint} answered {answer} after {elapsed_s:.1f} s "
            "(botocore retried it with backoff): the store is throttling or overloaded; ciuic "
            "retries within bounds, and a snapshot that still fails is logged and the next one "
            "tries again. If it persists, ask the store's operators about its rate limits "
            "and health")
    return StoreError(f"{what} {where} failed: {answer}")
