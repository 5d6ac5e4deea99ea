"""How a request's failure reaches its client: APIError, and its body in the
dialect of the API asked (OpenAI's {"error": {...}}, Anthropic's {"type":
"error", ...}, Ollama's {"error": "..."}), including a body that does not decode (decode_body: a 400
naming the field)."""

from __future__ import annotations

import re
from typing import Any

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Scope


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# A request ended by its client (a cancel, a hang-up): nginx's status for it.
CANCELLED = 499
# OpenAI's error types, for an error known by its status alone (a request that
# failed after it was admitted, Starlette's 404 and 405).
OPENAI_TYPES = {404: "not_found_error", CANCELLED: "cancelled", 503: "service_unavailable"}


def openai_error_type(status: int) -> str:
    return OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


# Anthropic's error types, by status.
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else
                                                                   "invalid_request_error"), "message": message}}


def is_anthropic(scope: Scope) -> bool:
    """Anthropic's API: its messages, and the models as its clients ask for them
    (/v1/models is both APIs'; Anthropic's SDKs send anthropic-version)."""
    path = scope["path"]
    return path.startswith("/v1/messages") or path.startswith("/v1/models") and any(
        name == b"anthropic-version" for name, _ in scope["headers"])


def is_ollama(path: str) -> bool:
    return path.startswith("/api/")


def error_payload(scope: Scope, status: int, message: str, type: str, param=None, code=None) -> bytes:
    """The error body in the dialect of the API the request is for (Ollama's is {"error": message})."""
    if is_anthropic(scope):
        body = anthropic_error_body(status, message)
    elif is_ollama(scope["path"]):
        body = {"error": message}
    else:
        body = error_body(message, type, param, code)
    return msgspec.json.encode(body)


def error_response(scope: Scope, e: APIError) -> Response:
    return Response(
        error_payload(scope, e.status, e.message, e.type, e.param, e.code),
        # Anthropic says "overloaded" with a 529, which its SDKs raise as OverloadedError.
        status_code=529 if e.status == 503 and is_anthropic(scope) else e.status,
        media_type="application/json",
        headers=e.headers,
    )


_PATH = re.compile(r" - at `\$\.?(.*)`$")


def decode_body(body: bytes, request_type: type):
    """Decode and validate a JSON body into `request_type`, or raise a 400.

    Lax, as the SDKs' and other servers' validators are: a whole number
    written as a float (`"n": 1.0`) is an int, a number written as a string is
    a number; anything that does not convert exactly is still a 400.
    """
    try:
        return msgspec.json.decode(body, type=request_type, strict=False)
    except msgspec.ValidationError as e:
        raise invalid(e) from None
    except msgspec.DecodeError as e:
        raise APIError(400, f"The body is not valid JSON: {e}", code="invalid_json") from None
    except UnicodeDecodeError as e:  # a string's bytes (a Latin-1 body's "café")
        raise APIError(400, f"The body is not valid UTF-8: a string holds the byte {e.object[e.start]:#04x}",
                       code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "The body's JSON is nested too deeply", code="invalid_json") from None


def convert(value: Any, kind: type, param: str) -> Any:
    """A part of a body decoded loosely (as plain JSON) checked as a `kind`, or a 400 naming its path under `param`."""
    try:
        return msgspec.convert(value, kind, strict=False)
    except msgspec.ValidationError as e:
        raise invalid(e, param) from None


def invalid(error: msgspec.ValidationError, under: str = "") -> APIError:
    """The 400 for a value that does not validate, naming its parameter (under `under`, for a part of a body)."""
    message = str(error)
    match = _PATH.search(message)
    # msgspec writes a dict's keys as [...]; the dict itself is the parameter.
    path = match.group(1).replace("[...]", "") if match and match.group(1) else ""
    param = under + ("." if under and path and not path.startswith("[") else "") + path or None
    unknown = re.match(r"Object contains unknown field `(.+?)`", message)
    if unknown:
        name = f"{param}.{unknown.group(1)}" if param else unknown.group(1)
        return APIError(400, f"Unsupported parameter: '{name}'", param=name, code="unsupported_parameter")
    # A body converted from plain JSON (Ollama's) has no names for its keys: `$[...][1][...]` helps no one.
    if match and match.group(1).startswith("[...]"):
        return APIError(400, _PATH.sub("", message), param=under or None)
    if under:
        message = _PATH.sub(f" - at `{param}`", message) if match else f"{message} - at `{param}`"
    return APIError(400, message, param=param)


# Starlette types every handler as taking an Exception; each is registered
# for one class only.


async def api_error_handler(request: Request, e: Exception) -> Response:
    assert isinstance(e, APIError)
    return error_response(request.scope, e)


async def http_error_handler(request: Request, e: Exception) -> Response:
    assert isinstance(e, HTTPException)
    return error_response(
        request.scope,
        APIError(e.status_code, str(e.detail), type=openai_error_type(e.status_code),
                 headers=dict(e.headers) if e.headers else None),  # a 405's Allow
    )


async def internal_error_handler(request: Request, _e: Exception) -> Response:
    # Starlette re-raises the exception after this, and uvicorn logs it.
    return error_response(request.scope, APIError(500, "internal server error", type="server_error"))
