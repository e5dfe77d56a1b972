"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

_TYPE_FOR_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # what OpenAI answers for a bad key (code invalid_api_key)
    404: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        retry_after: float | None = None,
        should_retry: bool | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPE_FOR_STATUS.get(status, "invalid_request_error")
        self.retry_after, self.should_retry = retry_after, should_retry
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = dict(self.headers)
        if self.retry_after is not None:
            headers["retry-after"] = str(max(1, round(self.retry_after)))
        if self.should_retry is not None:
            headers["x-should-retry"] = "true" if self.should_retry else "false"
        elif 400 <= self.status < 500 and self.status not in (408, 409, 429):
            headers["x-should-retry"] = "false"
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model '{model}' does not exist", param="model", code="model_not_found")


def model_unavailable(model: str) -> APIError:
    return APIError(
        503,
        f"The model '{model}' has no live engine right now; retry shortly",
        param="model",
        code="model_unavailable",
        retry_after=2,
    )
