"""The server's OpenAPI document: served at ``/openapi.json`` (and ``/docs``), printed by
``ciuic serve --openapi`` (the document of an app over an empty temporary store: it does not
depend on what a store holds).

FastAPI's own, with two corrections. It documents a 422 ``HTTPValidationError`` on every
route that takes parameters, but this server answers a request that does not validate with 400
and its one error body (:class:`~ciuic.server.schemas.ErrorBody`, ``invalid_request``): those
entries, and the two schemas only they used, are left out; a route's real 422s (``encrypted``,
``newer_format``, ``damaged``, ``invalid_run``) stay. And it drops every null from the document,
the examples' too (``"next": null`` of the audit log's last page): each answer's example is put
back as its model holds it.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from ciuic.server.schemas import Answer

_FASTAPI_422 = "#/components/schemas/HTTPValidationError"


def document(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI document (see the module docstring)."""
    doc = get_openapi(title=app.title, version=app.version, openapi_version=app.openapi_version,
                      description=app.description, routes=app.routes)
    for operations in doc.get("paths", {}).values():
        for operation in operations.values():
            answers = operation.get("responses", {})
            schema = (answers.get("422", {}).get("content", {}).get("application/json", {})
                      .get("schema", {}))
            if schema.get("$ref") == _FASTAPI_422:
                del answers["422"]
    schemas = doc.get("components", {}).get("schemas", {})
    if _FASTAPI_422 not in json.dumps(doc.get("paths", {})):
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
    for model in _answers(Answer):
        if model.example is not None and model.__name__ in schemas:
            schemas[model.__name__]["examples"] = [json.loads(json.dumps(model.example))]
    return doc


def _answers(model: type[Answer]) -> list[type[Answer]]:
    """``model`` and its subclasses, all the way down."""
    return [model, *(m for sub in model.__subclasses__() for m in _answers(sub))]


def install_document(app: FastAPI) -> None:
    """Serve :func:`document` as the app's schema (built once, on the first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

