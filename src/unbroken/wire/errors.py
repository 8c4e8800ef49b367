"""OpenAI-format errors.

Every API of unbroken answers failures with the body OpenAI clients parse::

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

`ApiError` is raised anywhere inside a handler; the middleware in `wire.http` renders it.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

__all__ = ["ApiError", "error_body", "error_response", "model_not_found"]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    # OpenAI answers an unknown model or URL with invalid_request_error (vLLM: NotFoundError).
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class ApiError(Exception):
    """An error that becomes an HTTP response with an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(
            status, "invalid_request_error" if status < 500 else "api_error"
        )
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> web.Response:
        return error_response(
            self.status,
            self.message,
            type=self.type,
            param=self.param,
            code=self.code,
            headers=self.headers,
        )


def model_not_found(model: object) -> ApiError:
    """The 404 of a model not served (vLLM's message; OpenAI's type and code): one answer
    for an unknown model and for one a tenant may not use, so that neither says more."""
    return ApiError(
        404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
    )


def error_body(
    message: str, *, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    *,
    type: str | None = None,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    body = error_body(message, type=type or _TYPES.get(status, "api_error"), param=param, code=code)
    return web.Response(
        status=status, body=orjson.dumps(body), content_type="application/json", headers=headers
    )
