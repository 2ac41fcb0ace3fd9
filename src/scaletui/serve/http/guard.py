"""Who may call /admin/*: a token off loopback, and never a web page the operator happens to visit;
and what a POST /admin/config body may hold (`config_changes`).

A browser lets any page POST `text/plain` to `http://127.0.0.1:8000/admin/config` without a
CORS preflight, and a DNS-rebinding page can reach the loopback port under its own host name.
So every /admin/* request needs a loopback `Host` on a loopback bind, an `Origin` (when a
browser sends one) of the same kind, and a mutation needs `Content-Type: application/json`,
which a cross-site page cannot send without a preflight this server never answers.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from aiohttp import web

from scaletui.procs import is_loopback_host
from scaletui.serve.http.errors import ApiError
from scaletui.shape import RECONFIGURABLE

is_loopback = is_loopback_host  # a host name or IP, not a URL
STRING_KEYS = ("mode", "dtype", "weight_dtype", "kv_dtype", "kernels")  # /admin/config strings


def _hostname(authority: str) -> str | None:
    """'[::1]:8000' -> '::1', 'LocalHost:80' -> 'localhost'; None when it does not parse."""
    try:
        return urlsplit("//" + authority).hostname
    except ValueError:
        return None


def check_admin(request: web.Request, bind: str, token: str | None) -> None:
    """Raise the 401/403/415 ApiError that refuses this /admin request, if any."""
    loopback_bind = is_loopback(bind)
    if token is None and not loopback_bind:
        raise ApiError(
            403,
            f"/admin is disabled on the non-loopback bind {bind}; start the "
            "server with --admin-token",
            code="forbidden",
        )
    host_header = request.headers.get("Host")
    host = _hostname(host_header) if host_header is not None else None
    if loopback_bind and host_header is not None and not is_loopback(host):
        raise ApiError(
            403,
            f"/admin refuses Host {host_header!r}: on a loopback bind it must "
            "be localhost or a loopback address (DNS rebinding)",
            code="forbidden",
        )
    origin = request.headers.get("Origin")
    if origin is not None:
        origin_host = _hostname(origin.split("://", 1)[-1]) if "://" in origin else None
        same = is_loopback(origin_host) if loopback_bind else origin_host == host
        if not same:
            raise ApiError(
                403, f"/admin refuses requests from the web origin {origin!r}", code="forbidden"
            )
    if token is not None and request.headers.get("Authorization") != f"Bearer {token}":
        raise ApiError(
            401,
            "/admin needs 'Authorization: Bearer <admin token>'",
            code="unauthorized",
            type="authentication_error",
        )
    if request.method == "POST" and request.content_type != "application/json":
        raise ApiError(
            415,
            f"/admin needs 'Content-Type: application/json', got {request.content_type!r}",
            code="unsupported_media_type",
        )


def config_changes(body: dict) -> dict:
    """A POST /admin/config body: reconfigurable keys only, each of its type (400 naming it)."""
    unknown = sorted(set(body) - set(RECONFIGURABLE))
    if unknown:
        raise ApiError(
            400,
            f"unknown config key(s) {unknown}; reconfigurable: {list(RECONFIGURABLE)}",
            unknown[0],
        )
    for key, value in body.items():
        want = str if key in STRING_KEYS else int
        if not isinstance(value, want) or isinstance(value, bool):
            raise ApiError(
                400,
                f"'{key}' must be {'a string' if want is str else 'an integer'}, got {value!r}",
                key,
            )
    return body
