"""OpenAI-shaped client errors: `ApiError` and the answer `http_error` gives for each
`events.ErrorKind` (a table keyed by the kind)."""

from __future__ import annotations

from scaletui.serve.scheduling.events import ErrorKind


class ApiError(Exception):
    """A client error with OpenAI's body shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type,
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }


# kind -> (status, OpenAI error type, code, message template)
HTTP_ERRORS: dict[ErrorKind, tuple[int, str, str, str]] = {
    ErrorKind.INVALID_REQUEST: (400, "invalid_request_error", "invalid_request", "{}"),
    ErrorKind.OVERLOADED: (
        429,
        "rate_limit_error",
        "rate_limit_exceeded",
        "server overloaded: {}; retry later",
    ),
    ErrorKind.UNAVAILABLE: (
        503,
        "server_error",
        "unavailable",
        "server not ready ({}); retry later",
    ),
    ErrorKind.BUSY: (409, "invalid_request_error", "conflict", "{}"),
    ErrorKind.ABORTED: (503, "server_error", "aborted", "{}"),
    ErrorKind.FAILED: (500, "server_error", "aborted", "{}"),
    ErrorKind.PROCESS_LOST: (503, "server_error", "process_lost", "{}"),
}


def http_error(kind: ErrorKind, message: str) -> ApiError:
    """The OpenAI-shaped answer to a refusal or failure of `kind`."""
    status, type_, code, template = HTTP_ERRORS[kind]
    return ApiError(status, template.format(message), code=code, type=type_)
