"""OpenAI-format errors and the middleware that turns every failure into one.

Body: {"error": {"message", "type", "param", "code"}}. A client never sees a
traceback: unexpected exceptions are logged with theirs and answered with 500.
"""

from __future__ import annotations

import asyncio
import uuid

import redis.exceptions
import structlog
from aiohttp import web

log = structlog.get_logger("gateway.errors")

MAX_BODY_BYTES = web.AppKey("max_body_bytes", int)
BODY_TIMEOUT = web.AppKey("body_timeout", float)
REQUEST_ID = web.RequestKey("request_id", str)


class APIError(Exception):
    """An error answer: raise anywhere in a handler, the middleware renders it."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None,
                 close_connection: bool = False):
        super().__init__(message)
        self.headers = headers or {}
        self.close_connection = close_connection  # the connection is closed after the answer
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        response = web.json_response(self.body(), status=self.status, headers=self.headers)
        if self.close_connection:
            response.force_close()
        return response


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def context_length_exceeded(message: str, param: str | None) -> APIError:
    """A prompt (+ completion) longer than the model's context or than any worker's KV cache holds: OpenAI's code."""
    return bad_request(message, param, "context_length_exceeded")


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model", "model_not_found")


def too_many_requests(message: str, retry_after: int) -> APIError:
    return APIError(429, f"{message}; retry later.", "rate_limit_error", None, "rate_limit_exceeded",
                    {"Retry-After": str(max(0, retry_after))})


def resume_not_found(request_id: str) -> APIError:
    """One answer for an unknown request and a wrong resume token: a guess learns nothing."""
    return APIError(404, f"No stream of request {request_id} to resume with this Last-Event-ID: the request is "
                    "unknown or ended too long ago, or the id is not one its stream sent (a stream's ids are "
                    "bound to the API key that submitted it).", "invalid_request_error", None, "resume_not_found")


def stream_in_use(request_id: str, retry_after: int) -> APIError:
    """A resume while a client is still served the stream: the connected client keeps it."""
    return APIError(409, f"The stream of request {request_id} is still being sent to a connected client; it can "
                    "be resumed once that connection has ended.", "invalid_request_error", None, "stream_in_use",
                    {"Retry-After": str(max(1, retry_after))})


def invalid_api_key(given: bool) -> APIError:
    """401 as OpenAI answers it."""
    message = ("Incorrect API key provided." if given else
               "You didn't provide an API key. You need to provide your API key in an Authorization header "
               "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
    return APIError(401, message, "invalid_request_error", None, "invalid_api_key" if given else None,
                    {"WWW-Authenticate": "Bearer"})


def quarantined(message: str) -> APIError:
    """A request the scheduler dead-lettered after workers failed with it: 422, which clients do not retry
    (a retry could take the next workers down)."""
    return APIError(422, message, "invalid_request_error", None, "request_quarantined")


def request_timeout(seconds: float) -> APIError:
    """The body did not arrive in time: the rest of it is never read, so the connection closes."""
    return APIError(408, f"The request body did not arrive within {seconds:g} s.", "invalid_request_error", None,
                    "request_timeout", close_connection=True)


async def read_body(request: web.Request) -> bytes:
    """The request's whole body within the app's BODY_TIMEOUT (408 beyond), at most its client_max_size (413)."""
    seconds = request.app.get(BODY_TIMEOUT) or None
    try:
        async with asyncio.timeout(seconds):
            return await request.read()
    except TimeoutError:
        raise request_timeout(seconds) from None


def gateway_timeout(message: str) -> APIError:
    return APIError(504, message, "server_error", None, "timeout")


def unavailable(message: str) -> APIError:
    return APIError(503, message, "server_error", None, "service_unavailable")


def internal_error(message: str = "Internal server error.") -> APIError:
    return APIError(500, message, "server_error", None, "internal_error")


# aiohttp's own HTTP errors (router misses, body too large, ...) in OpenAI shape
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def from_http_exception(exc: web.HTTPException, request: web.Request) -> APIError:
    status = exc.status
    if status == 404:
        message = f"Unknown route: {request.method} {request.path}"
    elif status == 405:
        message = f"Method {request.method} is not allowed on {request.path}"
    elif status == 413:
        limit = request.app.get(MAX_BODY_BYTES)
        message = f"Request body too large: the limit is {limit} bytes." if limit else "Request body too large."
    else:
        message = exc.reason or exc.text or "HTTP error"
    type_ = "invalid_request_error" if status < 500 else "server_error"
    # a 405 names the methods the route has (RFC 9110), as aiohttp's own answer does
    headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
    return APIError(status, message, type_, None, _HTTP_CODES.get(status), headers)


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Binds a request id for the logs, and renders every error as OpenAI JSON."""
    request_id = uuid.uuid4().hex
    request[REQUEST_ID] = request_id
    structlog.contextvars.bind_contextvars(request_id=request_id)
    closing = False
    try:
        response = await handler(request)
    except APIError as e:
        if e.status >= 500:
            log.warning("request failed", status=e.status, error=e.message)
        response = e.response()
        closing = e.close_connection
    except web.HTTPException as e:
        if e.status < 400:  # redirects and the like are not errors
            raise
        response = from_http_exception(e, request).response()
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
        log.warning("redis unavailable", error=str(e))
        response = unavailable("The request queue (Redis) is unavailable.").response()
    except Exception:
        log.exception("unhandled error")
        response = internal_error().response()
    if not response.prepared:
        response.headers["X-Request-Id"] = request_id
    if closing:  # the answer, then the connection closes: aiohttp would linger reading the unread rest for seconds
        await response.prepare(request)
        await response.write_eof()
        request.protocol.force_close()
    return response
