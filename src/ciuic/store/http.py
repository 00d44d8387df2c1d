"""A project on a ciuic server (``ciuic serve``), as a store: ``https://host/v1/projects/NAME``.

Every call is one HTTP request to the server's object API with the project's API key
(``Authorization: Bearer``), over a pooled keep-alive connection (``httpx``; ``pip install
'ciuic[client]'``). What the client writes is exactly what it writes to any store (chunks, then
the body, then the manifest create: the commit), so encryption stays on the client and only
missing chunks are sent. The key comes from the constructor or ``CIUIC_API_KEY``.

Errors: 401/403 raise :class:`~ciuic.errors.StoreAccessError` at once (a wrong key does not get
better by retrying); 404 is :class:`~ciuic.errors.ObjectNotFound`; anything else, including a
server that cannot be reached, is a :class:`~ciuic.errors.StoreError` that
:class:`~ciuic.store.retry.RetryingStore` retries within bounds; an answer that is not the JSON
the API gives is one too.

TLS: an ``https://`` server's certificate is verified against ``CIUIC_CA`` (a PEM file of the
certificate authority, or of the server's own self-signed certificate; or a directory of them)
when set, else against the system's trust store. A certificate that fails to verify raises
:class:`~ciuic.errors.StoreAccessError` at once, saying what to set.
"""

from __future__ import annotations

import builtins
import contextlib
import ipaddress
import logging
import os
import ssl
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import quote, urlparse

from ciuic import knobs
from ciuic.errors import (
    ConfigurationError,
    CorruptObject,
    ObjectNotFound,
    StoreAccessError,
    StoreError,
)
from ciuic.format import canonical
from ciuic.store.base import Data, Store, check_key, check_prefix, joined
from ciuic.threads import Pools

log = logging.getLogger("ciuic")
_MISSING_BATCH = 10_000  # keys per "missing" request (the server takes up to 100 000)


def split_url(url: str) -> tuple[str, str]:
    """(endpoint, project) of ``https://host[:port]/v1/projects/NAME``."""
    parsed = urlparse(url)
    parts = parsed.path.rstrip("/").split("/")
    if len(parts) < 4 or parts[-3:-1] != ["v1", "projects"] or not parts[-1]:
        raise ConfigurationError(f"{url!r} is not a ciuic server project URL; use "
                                 "https://HOST/v1/projects/PROJECT")
    base = "/".join(parts[:-3])
    return f"{parsed.scheme}://{parsed.netloc}{base}", parts[-1]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is this machine's loopback: a name other than
    ``localhost`` may resolve to anything, so it is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def tls_context() -> ssl.SSLContext:
    """How a client verifies a server's certificate: against ``CIUIC_CA`` (a PEM file or a
    directory of them) when set, else the system's trust store (``SSL_CERT_FILE`` and
    ``SSL_CERT_DIR`` move it)."""
    ca = os.environ.get("CIUIC_CA")
    if not ca:
        return ssl.create_default_context()
    if not os.path.exists(ca):
        raise ConfigurationError(f"CIUIC_CA is {ca!r}, which does not exist; set it to the PEM "
                                 "file of the certificate authority that signed the server's "
                                 "certificate (or to the server's self-signed certificate)")
    try:
        if os.path.isdir(ca):
            return ssl.create_default_context(capath=ca)
        return ssl.create_default_context(cafile=ca)
    except (ssl.SSLError, ValueError) as e:
        raise ConfigurationError(f"CIUIC_CA {ca!r} holds no usable PEM certificate: {e}") from e


def _untrusted(e: BaseException) -> ssl.SSLCertVerificationError | None:
    """The certificate failure inside an HTTP error, if it is one."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


class HttpStore(Store):
    """The objects of one project on a ciuic server."""

    write_bytes_per_s = 5e7  # a network: compression pays
    batch_missing = True  # one POST answers a whole snapshot's chunks

    def __init__(self, url_or_endpoint: str, project: str | None = None,
                 api_key: str | None = None, *, timeout_s: float | None = None) -> None:
        try:
            import httpx
        except ImportError as e:  # pragma: no cover - depends on optional packages
            raise ConfigurationError("talking to a ciuic server needs httpx: pip install "
                                     "'ciuic[client]'") from e
        if project is None:
            endpoint, project = split_url(url_or_endpoint)
        else:
            endpoint = url_or_endpoint.rstrip("/")
        if urlparse(endpoint).scheme not in ("http", "https"):
            raise ConfigurationError(f"the server endpoint must be an http(s) URL, got "
                                     f"{endpoint!r}")
        key = api_key or os.environ.get("CIUIC_API_KEY")
        if not key:
            raise ConfigurationError("no API key: pass api_key=... or set CIUIC_API_KEY (an "
                                     "admin makes one with `ciuic apikey create`)")
        self.endpoint, self.project = endpoint, project
        self.url = f"{endpoint}/v1/projects/{project}"
        timeout = timeout_s if timeout_s is not None else knobs.get().s3_read_timeout_s
        self._httpx = httpx
        self._client = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {key}"},
            timeout=httpx.Timeout(timeout, connect=knobs.get().s3_connect_timeout_s),
            limits=httpx.Limits(max_connections=32, max_keepalive_connections=32),
            verify=tls_context() if urlparse(endpoint).scheme == "https" else True)
        host = urlparse(endpoint).hostname or ""
        if urlparse(endpoint).scheme == "http" and not is_loopback(host):
            log.warning("the ciuic server at %s is reached over plain HTTP: the API key crosses "
                        "the network in cleartext; use https:// (docs/server.md, \"TLS\")",
                        endpoint)
        #: a batch's PUTs in parallel (the client is shared between threads)
        self._pools = Pools(knobs.get().s3_concurrency, "ciuic-http")

    def _send(self, method: str, path: str, **kw: Any) -> Any:
        """One request; :class:`StoreAccessError` for a certificate that does not verify (it
        does not get better by retrying), :class:`StoreError` for a server not reached."""
        try:
            return self._client.request(method, path, **kw)
        except self._httpx.HTTPError as e:
            bad = _untrusted(e)
            if bad is not None:
                raise StoreAccessError(
                    f"the ciuic server at {self.endpoint} presented a certificate this client "
                    f"does not trust ({bad.verify_message or bad}): set CIUIC_CA to the PEM "
                    "file of the certificate authority that signed it (or to the server's "
                    "self-signed certificate), or add that authority to the system's trust "
                    "store; check that the URL's host is one the certificate names") from None
            raise StoreError(f"cannot reach the ciuic server at {self.endpoint}: {e}") from e

    def _answer(self, r: Any, *fields: str) -> dict[str, Any]:
        """A JSON answer holding ``fields``; :class:`StoreError` when it is not one."""
        where = f"{r.request.method} {r.request.url.path}"
        try:
            value = canonical.parse(r.content, where, "answer", floats=True)
        except CorruptObject as e:
            raise StoreError(f"the ciuic server at {self.endpoint} answered {where} with "
                             f"{e.reason}") from None
        if not (isinstance(value, dict) and all(f in value for f in fields)):
            raise StoreError(f"the ciuic server at {self.endpoint} answered {where} without "
                             f"{', '.join(fields)}: {r.text[:200]!r}")
        return value

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        r = self._send(method, path, **kw)
        if r.status_code in (401, 403):
            raise StoreAccessError(f"the ciuic server at {self.endpoint} refused the request "
                                   f"({r.status_code}): {_message(r)}")
        if r.status_code == 404:
            raise ObjectNotFound(f"{self.url}{path} does not exist")
        if r.status_code >= 400 and not (r.status_code == 409 and method == "PUT") and not (
                r.status_code == 416 and "content-range" in r.headers):  # a range past the end
            raise StoreError(f"the ciuic server answered {r.status_code} to {method} {path}: "
                             f"{_message(r)}")
        return r

    @staticmethod
    def _obj(key: str) -> str:
        return "/objects/" + quote(check_key(key))

    def put(self, key: str, data: Data, *, durable: bool = True) -> None:
        self._call("PUT", self._obj(key), content=joined(data))

    def put_many(self, items: Sequence[tuple[str, Data]], *, durable: bool = True) -> None:
        """A batch's objects sent in parallel requests: one after another, a batch of small
        chunks waited as many round trips as it has chunks."""
        self._pools.each(lambda item: self.put(*item), items)

    def create(self, key: str, data: Data) -> bool:
        r = self._call("PUT", self._obj(key), content=joined(data), params={"create": "true"})
        return bool(r.status_code == 201)

    def get(self, key: str) -> bytes:
        return bytes(self._call("GET", self._obj(key)).content)

    def get_into(self, key: str, buffers: builtins.list[memoryview], offset: int = 0) -> int:
        """One GET of the range the buffers hold (``Range: bytes=``), not the whole object."""
        if offset < 0:
            raise ValueError(f"a read starts at an offset of 0 or more, not {offset}")
        views = [memoryview(b).cast("B") for b in buffers if len(b)]
        want = sum(len(v) for v in views)
        while True:  # a server answers at most 64 MiB a request: ask again for the rest
            r = self._call("GET", self._obj(key),
                           headers={"Range": f"bytes={offset}-{offset + max(1, want) - 1}"})
            if r.status_code == 416:  # at or past the end: the size in "bytes */size"
                return int(r.headers["content-range"].rpartition("/")[2])
            if r.status_code == 206:
                total = int(r.headers["content-range"].rpartition("/")[2])
                data = memoryview(r.content)
            else:  # a server that ignored the range: the whole object came
                total = len(r.content)
                data = memoryview(r.content)[offset:]
            n = min(len(data), want)
            _fill(views, data[:n])
            offset, want = offset + n, want - n
            if not want or not n or offset >= total or r.status_code != 206:
                return total

    def has(self, key: str) -> bool:
        try:
            self._call("HEAD", self._obj(key))
        except ObjectNotFound:
            return False
        return True

    def missing(self, keys: builtins.list[str]) -> builtins.list[str]:
        """Which of ``keys`` the server lacks (one request)."""
        for k in keys:
            check_key(k)
        out: builtins.list[str] = []
        for i in range(0, len(keys), _MISSING_BATCH):
            r = self._call("POST", "/objects/missing",
                           json={"keys": keys[i:i + _MISSING_BATCH]})
            out += [str(k) for k in self._answer(r, "missing")["missing"]]
        return out

    def list(self, prefix: str = "") -> Iterator[str]:
        check_prefix(prefix)
        after = ""
        while True:
            page = self._answer(self._call("GET", "/objects",
                                           params={"prefix": prefix, "after": after}),
                                "keys", "more")
            yield from page["keys"]
            if not page["more"] or not page["keys"]:
                return
            after = page["keys"][-1]

    def delete(self, key: str) -> None:
        with contextlib.suppress(ObjectNotFound):  # deleting a missing key is not an error
            self._call("DELETE", self._obj(key))

    def report_run(self, job: str, run_id: str, report: dict[str, Any]) -> None:
        """Send a run's record and new events (``ciuic.manager.report``)."""
        self._call("PUT", f"/jobs/{quote(job)}/runs/{quote(run_id)}", json=report)

    def gc(self, dry_run: bool = False, wait_s: float = 0.0) -> dict[str, Any]:
        """Run the server's gc of this project (the only way a server's chunks are deleted):
        ``GcResult``'s fields."""
        r = self._call("POST", "/gc", params={"dry_run": str(dry_run).lower(),
                                              "wait_s": min(wait_s, 30.0)},
                       timeout=max(self._client.timeout.read or 0, wait_s + 600))
        return dict(r.json())

    def audit(self, **filters: Any) -> dict[str, Any]:
        """A page of the project's audit log (an admin key): ``{"events", "next"}``; filters
        as ``GET /v1/projects/P/audit`` takes them (None: not filtered)."""
        params = {k: v for k, v in filters.items() if v is not None}
        return dict(self._call("GET", "/audit", params=params).json())

    def whoami(self) -> dict[str, Any]:
        """The key's project and role, as the server sees them."""
        r = self._send("GET", f"{self.endpoint}/v1/whoami")
        if r.status_code in (401, 403):
            raise StoreAccessError(f"the ciuic server at {self.endpoint} refused the key: "
                                   f"{_message(r)}")
        if r.status_code >= 400:
            raise StoreError(f"the ciuic server answered {r.status_code}: {_message(r)}")
        return self._answer(r, "project")

    def close(self) -> None:
        self._pools.shutdown()
        self._client.close()


def _message(r: Any) -> str:
    try:
        return str(r.json()["error"]["message"])
    except Exception:
        return str(r.text[:200])


def _fill(views: builtins.list[memoryview], data: memoryview) -> None:
    """Copy ``data`` into the front of ``views``, dropping the views it fills."""
    at = 0
    while views and at < len(data):
        n = min(len(views[0]), len(data) - at)
        views[0][:n] = data[at:at + n]
        at += n
        views[0] = views[0][n:]
        if not len(views[0]):
            views.pop(0)
