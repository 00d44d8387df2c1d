"""Operations: Prometheus metrics at ``/metrics`` and one structured (JSON) log line per request.

Metrics (each app has its own registry, so several apps in one process never mix):

- ``ciuic_requests_total{method, route, status}`` and ``ciuic_request_seconds{method, route}``
  (a histogram): every request, by route template (``/v1/projects/{project}/objects/{key}``,
  never a raw path, so the label set stays bounded);
- ``ciuic_errors_total{route, code}``: responses of 500 and above;
- ``ciuic_snapshots_total{project}``: commits (manifest creates);
- ``ciuic_object_bytes_total{direction}``: bytes received and sent in objects.

``/metrics`` needs an API key, of any role (a scraper sends it as a bearer token); the series
labelled with a project show the key's project only, so no key learns another project's name.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterator

from fastapi import FastAPI, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    Metric,
    generate_latest,
)

from ciuic.server.schemas import METRICS_TEXT, errors

access = logging.getLogger("ciuic.server.access")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ciuic_requests_total", "HTTP requests",
                                ["method", "route", "status"], registry=r)
        self.latency = Histogram("ciuic_request_seconds", "HTTP request latency",
                                 ["method", "route"], registry=r,
                                 buckets=(.001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
        self.errors = Counter("ciuic_errors_total", "responses with status >= 500",
                              ["route", "code"], registry=r)
        self.snapshots = Counter("ciuic_snapshots_total", "snapshots committed", ["project"],
                                 registry=r)
        self.bytes = Counter("ciuic_object_bytes_total", "object bytes received or sent",
                             ["direction"], registry=r)


def install(app: FastAPI) -> Metrics:
    """Add the metrics endpoint and the per-request middleware to ``app``."""
    metrics = Metrics()

    @app.middleware("http")
    async def observe(request: Request,
                      call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        t0 = time.perf_counter()
        status = 500
        try:
            response = await call_next(request)
            status = response.status_code
            return response
        finally:
            route = getattr(request.scope.get("route"), "path", "unmatched")
            elapsed = time.perf_counter() - t0
            metrics.requests.labels(request.method, route, str(status)).inc()
            metrics.latency.labels(request.method, route).observe(elapsed)
            if status >= 500:
                metrics.errors.labels(route, str(status)).inc()
            access.info(json.dumps({
                "method": request.method, "route": route, "path": request.url.path,
                "status": status, "ms": round(elapsed * 1000, 2),
                "key": getattr(request.state, "key_id", None),
                "client": request.client.host if request.client else None}))

    @app.get("/metrics", tags=["operations"], response_class=Response,
             responses={200: METRICS_TEXT, **errors(401)})
    def prometheus(request: Request) -> Response:
        """The metrics (any API key; the key's project's series only)."""
        project = request.state.key.project  # the key was checked first (ciuic.server.guard)
        return Response(generate_latest(_OfProject(metrics.registry, project)),
                        media_type=CONTENT_TYPE_LATEST)

    return metrics


class _OfProject:
    """A registry's metrics without the samples labelled with another project."""

    def __init__(self, registry: CollectorRegistry, project: str) -> None:
        self.registry, self.project = registry, project

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():  # fresh objects on every call
            family.samples = [s for s in family.samples
                              if s.labels.get("project", self.project) == self.project]
            yield family
