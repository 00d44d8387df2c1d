"""``s3://bucket/prefix``: any S3-protocol object store (AWS S3, MinIO, Ceph RGW) through boto3.

Configuration is boto3's own: credentials and region from the environment, ``~/.aws``, or an
instance role; the endpoint from ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3``. The URL's query
may override some of it for one store (handy for ``ciuic push`` to another cluster)::

    s3://bucket/prefix?endpoint=http://10.0.0.5:9000&region=eu-west-1&conditional=auto

Transfers: objects above ``s3_multipart_threshold_bytes`` go up as a multipart upload with parts
sent in parallel and come back as parallel ranged GETs. Every call has connect and read timeouts
and botocore's adaptive retry mode (5 attempts, slowing down when the server throttles), its
backoff's jitter drawn from a generator of the store's own, never from the global ``random``
(:func:`private_jitter`: a retried call must not change what training computes);
:class:`~ciuic.store.retry.RetryingStore` adds ciuic's own bounded retries on top, as for every
store. What servers answer differently (limits, error codes, throttling): ``s3dialect``.

Commit: :meth:`S3Store.create` is a PUT with ``If-None-Match: *`` (AWS S3 since 2024, MinIO,
Ceph RGW, moto), so exactly one of several racing writers wins. ``conditional=auto`` (the
default) probes the server once; a server that ignores the header (it would silently overwrite)
gets the documented fallback: HEAD, then PUT, then read back, serialised within the process.
That fallback is safe for everything ciuic creates except a race between two processes on the
same key with different content (two writers of one job at the same instant, or two
first-time passphrase set-ups); the lease's fencing token narrows the first, see
``docs/architecture.md``. There is no cross-process lock on S3 (:meth:`Store.lock` is a no-op).
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import random
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlparse

from ciuic import knobs
from ciuic.errors import ConfigurationError, ObjectNotFound, StoreAccessError, StoreError
from ciuic.store import s3dialect
from ciuic.store.base import Data, Store, check_key, check_prefix, joined, size
from ciuic.threads import Pools
from ciuic.words import listed

T = TypeVar("T")
log = logging.getLogger("ciuic")

_CONDITIONAL_MODES = ("auto", "always", "never")


def private_jitter(client: Any) -> bool:
    """Give ``client``'s retry backoff a ``random.Random`` of its own.

    botocore's standard and adaptive retries draw each backoff's jitter from the global
    ``random`` (``ExponentialBackoff(random=random.random)``): an S3 call retried in ciuic's
    writer thread advanced the training's Python RNG, so a run that rode out a store outage
    computed different weights from the same run without it (issue #42). botocore offers no
    option for it; the handler is found by the unique ID botocore registers it under. Returns
    whether it was found (or the client's retries are botocore's legacy ones, which draw from
    ``random`` at module level: :func:`private_module_random`); where not (another botocore),
    says so in the log.
    """
    if client.meta.config.retries.get("mode") == "legacy":
        return True  # it draws from retryhandler's module-level random: private_module_random
    events = getattr(client.meta.events, "_emitter", client.meta.events)  # an EventAliaser's
    name = client.meta.service_model.service_id.hyphenize()
    entry = getattr(events, "_unique_id_handlers", {}).get(f"retry-config-{name}")
    handler = getattr(entry["handler"], "__self__", None) if entry else None
    backoff = getattr(getattr(handler, "_retry_policy", None), "_retry_backoff", None)
    if backoff is None or not callable(getattr(backoff, "_random", None)):
        log.warning("the S3 client's retry backoff was not found (botocore %s, retry mode %s): "
                    "a retried S3 call may draw from the global random generator",
                    getattr(sys.modules.get("botocore"), "__version__", "?"),
                    client.meta.config.retries.get("mode", "?"))
        return False
    backoff._random = random.Random().random
    return True


def private_module_random() -> None:
    """Give botocore's modules that draw from ``random`` at call time a generator of their own:
    its legacy retry mode's jitter (``retryhandler``) and an EC2 instance role's credential
    refresh (``utils``: a draw on each fetch from the instance metadata, at a moment set by the
    clock, in the thread of the S3 call: ciuic's writer). botocore's draws stay random; the
    training's ``random`` is left alone."""
    import botocore.retryhandler
    import botocore.utils

    for module in (botocore.retryhandler, botocore.utils):
        if getattr(module, "random", None) is random:
            module.random = random.Random()


class S3Store(Store):
    """A store in an S3 bucket, under an optional key prefix. Thread-safe."""

    write_bytes_per_s = 50e6  # one S3 connection, typically

    def __init__(self, url: str, *, client: Any = None) -> None:
        try:
            import boto3
            from botocore.config import Config
        except ImportError as e:  # pragma: no cover - depends on optional packages
            raise ConfigurationError(
                "the s3:// store needs boto3: pip install 'ciuic[s3]'") from e
        parsed = urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise ConfigurationError(
                f"bad S3 store URL {url!r}: write s3://BUCKET or s3://BUCKET/PREFIX")
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        if self.prefix:
            try:
                check_prefix(self.prefix)
            except ValueError as e:
                raise ConfigurationError(f"bad key prefix in S3 store URL {url!r}: {e}") from None
        query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
        unknown = set(query) - {"endpoint", "region", "conditional"}
        if unknown:
            raise ConfigurationError(
                f"unknown {listed([repr(k) for k in sorted(unknown)], 'option')} in S3 store "
                f"URL {url!r}; "
                "known: endpoint, region, conditional")
        self.conditional = query.get("conditional", "auto")
        if self.conditional not in _CONDITIONAL_MODES:
            raise ConfigurationError(
                f"conditional={self.conditional!r} in {url!r}: use one of {_CONDITIONAL_MODES}")
        self.url = url
        k = knobs.get()
        self._part_bytes = k.s3_part_bytes
        self._threshold = max(k.s3_multipart_threshold_bytes, self._part_bytes)
        private_module_random()
        if client is None:
            session = boto3.session.Session()
            config = Config(
                connect_timeout=k.s3_connect_timeout_s, read_timeout=k.s3_read_timeout_s,
                # adaptive: botocore's standard retries, and a client-side rate limit once the
                # server throttles (503 SlowDown); 3 attempts lost writes to a throttling
                # radosgw (docs/storage.md)
                retries={"mode": "adaptive", "max_attempts": 5},
                max_pool_connections=max(32, 2 * k.s3_concurrency),
            )
            client = session.client(
                "s3", endpoint_url=query.get("endpoint"),
                region_name=query.get("region") or session.region_name or "us-east-1",
                config=config)
        private_jitter(client)
        self._client = client
        self._endpoint = str(getattr(client.meta, "endpoint_url", "")) or "AWS S3"
        self._pools = Pools(k.s3_concurrency, "ciuic-s3")  # the caller's priority
        self._probe_lock = threading.Lock()
        self._conditional_ok: bool | None = {"always": True, "never": False}.get(
            self.conditional)
        self._fallback_lock = threading.Lock()
        #: whether the server accepted these credentials once (s3dialect.translate)
        self._accepted = False

    # -- helpers ---------------------------------------------------------------------------

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def location(self, key: str = "") -> str:
        base = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        return f"{base}/{key}" if key else base

    def _call(self, what: str, key: str, fn: Callable[[], T]) -> T:
        """Run one boto3 call and turn its failures into ciuic's errors (s3dialect.translate
        names the real cause of a misleading answer)."""
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        started = time.monotonic()
        try:
            result = fn()
        except ClientError as e:
            error = s3dialect.translate(
                e, what=what, where=self.location(key), endpoint=self._endpoint,
                bucket=self.bucket, elapsed_s=time.monotonic() - started,
                accepted=self._accepted)
            if isinstance(error, ObjectNotFound):
                self._accepted = True  # a 404 is an authenticated answer
                raise error from None
            raise error from e
        except NoCredentialsError as e:
            raise StoreAccessError(
                f"{what} {self.location(key)}: no AWS credentials found; set "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE") from e
        except BotoCoreError as e:
            raise StoreError(f"{what} {self.location(key)} failed at {self._endpoint}: {e}"
                             f"{s3dialect.hint(e)}") from e
        self._accepted = True
        return result

    # -- writing ---------------------------------------------------------------------------

    def put(self, key: str, data: Data, *, durable: bool = True) -> None:
        check_key(key)
        self._call("writing", key, lambda: self._upload(key, data, conditional=False))

    def put_many(self, items: Sequence[tuple[str, Data]], *, durable: bool = True) -> None:
        """The objects of a batch uploaded in parallel (each PUT waits a round trip or two: one
        after another, a batch of small chunks took as many round trips as it has chunks);
        those large enough for a multipart upload one after another, each in parallel parts."""
        large = [size(data) > self._threshold for _, data in items]
        self._pools.each(lambda item: self.put(*item),
                         [item for item, big in zip(items, large, strict=True) if not big])
        for item, big in zip(items, large, strict=True):
            if big:  # (its parts go to the pools: not sent from a pool's thread)
                self.put(*item)

    def _upload(self, key: str, data: Data, *, conditional: bool) -> None:
        """PUT (or multipart upload) ``data``; raises ClientError 412 if ``conditional`` and
        the key exists. S3 writes are durable when the call returns."""
        nbytes = size(data)
        extra = {"IfNoneMatch": "*"} if conditional else {}
        if nbytes <= self._threshold:
            body = joined(data)
            self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=body, **extra)
            return
        self._multipart(key, data, nbytes, extra)

    def _multipart(self, key: str, data: Data, nbytes: int, extra: dict[str, str]) -> None:
        blob = memoryview(joined(data))
        name = self._key(key)
        upload = self._client.create_multipart_upload(Bucket=self.bucket, Key=name)["UploadId"]
        step = s3dialect.part_bytes(self._part_bytes, nbytes)

        def send(start: int) -> dict[str, Any]:
            number = start // step + 1
            part = bytes(blob[start:start + step])
            etag = self._client.upload_part(Bucket=self.bucket, Key=name, UploadId=upload,
                                            PartNumber=number, Body=part)["ETag"]
            return {"ETag": etag, "PartNumber": number}

        try:
            # every part finished before an abort: a part still uploading could outlive it
            done = self._pools.each(send, range(0, nbytes, step))
            self._client.complete_multipart_upload(
                Bucket=self.bucket, Key=name, UploadId=upload,
                MultipartUpload={"Parts": done}, **extra)
        except BaseException:
            with contextlib.suppress(Exception):  # the original error matters, not this one
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=name,
                                                    UploadId=upload)
            raise

    def create(self, key: str, data: Data) -> bool:
        check_key(key)
        if self._supports_conditional():
            return self._call("creating", key, lambda: self._create_conditional(key, data))
        with self._fallback_lock:
            if self.has(key):
                return False
            self._call("creating", key, lambda: self._upload(key, data, conditional=False))
            return self.get(key) == joined(data)

    def _create_conditional(self, key: str, data: Data) -> bool:
        from botocore.exceptions import ClientError

        try:
            self._upload(key, data, conditional=True)
            return True
        except ClientError as e:
            code = s3dialect.code(e)
            if code in ("PreconditionFailed", "412"):
                return False
            if code == "ConditionalRequestConflict":  # a racing create: exactly one wins
                self._call("reading", key, lambda: self._head(key))
                return False
            raise

    def _supports_conditional(self) -> bool:
        """Whether the server honours ``If-None-Match: *`` (probed once, with a scratch key)."""
        with self._probe_lock:
            if self._conditional_ok is None:
                probe = f".ciuic-probe/{uuid.uuid4().hex}"
                first = self._call("probing", probe,
                                   lambda: self._create_conditional(probe, b"1"))
                second = self._call("probing", probe,
                                    lambda: self._create_conditional(probe, b"2"))
                self.delete(probe)
                self._conditional_ok = first and not second
            return self._conditional_ok

    def sync(self) -> None:
        """Nothing to do: an S3 PUT is durable when it returns."""

    # -- reading ---------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        check_key(key)
        out: list[bytearray] = []

        def fill(total: int) -> list[memoryview]:
            out.append(bytearray(total))
            return [memoryview(out[0])]

        self._call("reading", key, lambda: self._download(key, fill))
        return bytes(out[0])

    def get_into(self, key: str, buffers: list[memoryview], offset: int = 0) -> int:
        check_key(key)
        if offset < 0:
            raise ValueError(f"a read starts at an offset of 0 or more, not {offset}")
        want = sum(len(b) for b in buffers)
        return self._call("reading", key,
                          lambda: self._download(key, lambda _n: buffers, offset, want))

    def _download(self, key: str, targets: Callable[[int], list[memoryview]],
                  offset: int = 0, want: int | None = None) -> int:
        """GET ``key``'s bytes from ``offset`` (``want`` of them at most; None: to the end)
        into the buffers ``targets(size)`` returns; more than one part comes back as parallel
        ranged GETs. Returns the object's size."""
        from botocore.exceptions import ClientError

        name = self._key(key)
        first_len = self._part_bytes if want is None else max(1, min(want, self._part_bytes))
        skip = 0  # bytes before ``offset`` that came anyway (a server that ignores Range)
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=name,
                                           Range=f"bytes={offset}-{offset + first_len - 1}")
            total = int(str(resp["ContentRange"]).rpartition("/")[2])
        except ClientError as e:
            if s3dialect.code(e) != "InvalidRange":
                raise
            if offset:  # at or past the end: nothing to read
                return int(self._head(key)["ContentLength"])
            resp, total = self._client.get_object(Bucket=self.bucket, Key=name), 0
        except KeyError:  # a server that ignored the Range header: the whole object came
            total, skip = int(resp["ContentLength"]), offset
        views = [v.cast("B") for v in targets(total)]
        end = total if want is None else min(total, offset + want)
        came = int(resp["ContentLength"])
        _skip(resp["Body"], min(skip, came))
        _read_into(resp["Body"], views, 0, max(0, came - skip))
        first = offset + came - skip
        if first < end:
            etag = resp.get("ETag")

            def fetch(start: int) -> None:
                last = min(start + self._part_bytes, end) - 1
                extra = {"IfMatch": etag} if etag else {}
                part = self._client.get_object(Bucket=self.bucket, Key=name,
                                               Range=f"bytes={start}-{last}", **extra)
                _read_into(part["Body"], views, start - offset, last + 1 - start)

            # (every fetch done before a failure is raised: none writes into the buffers after)
            self._pools.each(fetch, range(first, end, self._part_bytes))
        return total

    def _head(self, key: str) -> dict[str, Any]:
        result: dict[str, Any] = self._client.head_object(Bucket=self.bucket, Key=self._key(key))
        return result

    def has(self, key: str) -> bool:
        check_key(key)
        try:
            self._call("checking", key, lambda: self._head(key))
        except ObjectNotFound:
            return False
        return True

    def missing(self, keys: builtins.list[str]) -> builtins.list[str]:
        """Asked with parallel HEAD requests (S3 has no call that asks about many keys)."""
        found = self._pools.each(self.has, keys)
        return [k for k, present in zip(keys, found, strict=True) if not present]

    def list(self, prefix: str = "") -> Iterator[str]:
        check_prefix(prefix)
        base = f"{self.prefix}/" if self.prefix else ""

        def collect() -> list[str]:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base + prefix)
            return [obj["Key"][len(base):] for page in pages for obj in page.get("Contents", [])]

        keys = self._call("listing", prefix, collect)
        return iter(sorted(k for k in keys if not k.startswith(".ciuic-probe/")))

    def children(self, prefix: str) -> builtins.list[str]:
        """One listing with a delimiter: S3 answers the names below ``prefix`` as "common
        prefixes" (folders) and keys, without listing what is under each."""
        check_prefix(prefix)
        if not prefix.endswith("/"):
            raise ValueError(f"children() takes a prefix that ends with '/', got {prefix!r}")
        full = (f"{self.prefix}/" if self.prefix else "") + prefix

        def collect() -> builtins.list[str]:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=full, Delimiter="/")
            names: set[str] = set()
            for page in pages:
                names.update(p["Prefix"][len(full):].rstrip("/")
                             for p in page.get("CommonPrefixes", []))
                names.update(o["Key"][len(full):] for o in page.get("Contents", []))
            return sorted(names)

        return self._call("listing", prefix, collect)

    def delete(self, key: str) -> None:
        check_key(key)
        self._call("deleting", key,
                   lambda: self._client.delete_object(Bucket=self.bucket, Key=self._key(key)))

    def close(self) -> None:
        self._pools.shutdown()


def _skip(body: Any, n: int) -> None:
    """Read and drop the first ``n`` bytes of a streaming body."""
    while n:
        data = body.read(min(n, 8 << 20))
        if not data:
            raise StoreError("the S3 response ended early")
        n -= len(data)


def _read_into(body: Any, views: list[memoryview], offset: int, length: int) -> None:
    """Copy ``length`` bytes of a streaming body into the concatenation of ``views`` starting at
    ``offset``; bytes past the views' end are read and dropped."""
    remaining = length
    pos = offset
    for view in views:
        if pos >= len(view):
            pos -= len(view)
            continue
        while remaining and pos < len(view):
            data = body.read(min(len(view) - pos, remaining, 8 << 20))
            if not data:
                raise StoreError("the S3 response ended early")
            view[pos:pos + len(data)] = data
            pos += len(data)
            remaining -= len(data)
        pos = 0
        if not remaining:
            break
    while remaining:  # beyond the caller's buffers
        data = body.read(min(remaining, 8 << 20))
        if not data:
            raise StoreError("the S3 response ended early")
        remaining -= len(data)
    body.close()
