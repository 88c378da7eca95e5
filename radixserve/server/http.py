"""HTTP plumbing shared by the server's routes and the router: JSON bodies, error bodies,
JSON and server-sent-event responses, the API key and origin check."""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable
from urllib.parse import urlsplit

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

OPEN_PATHS = {"/health", "/dashboard"}  # everything else needs the API key when one is set


class RequestError(Exception):
    """A request that cannot be served: becomes an HTTP 4xx (or 503) with this message."""

    def __init__(self, message: str, status: int = 400, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


async def parse_body(request: Request, model: type[BaseModel]) -> BaseModel:
    """The JSON body as `model`: a body that is not `application/json` is a 415, one over
    --max-request-bytes a 413, malformed or mistyped input a 400 naming the field."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/json":
        raise RequestError(
            f"Content-Type must be application/json, got {content_type or 'none'!r}", 415
        )
    raw = await read_body(request, request.app.state.args.max_request_bytes)
    try:
        data = orjson.loads(raw or b"{}")
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"malformed JSON body: {exc}") from exc
    if not isinstance(data, dict):
        raise RequestError("the JSON body must be an object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from exc


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise RequestError(
            f"the request body has {declared} bytes; this server accepts at most {limit}", 413
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(f"the request body exceeds {limit} bytes", 413)
        chunks.append(chunk)
    return b"".join(chunks)


def error_response(
    message: str, status: int = 400, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, status), status_code=status, headers=headers)


def error_body(message: str, status: int) -> dict:
    kind = {
        400: "BadRequestError",
        401: "AuthenticationError",
        403: "PermissionDeniedError",
        404: "NotFoundError",
        413: "RequestTooLargeError",
        415: "UnsupportedMediaTypeError",
        499: "ClientClosedRequest",
        503: "ServiceUnavailableError",
    }.get(status, "Error")
    return {
        "object": "error",
        "message": message,
        "type": kind,
        "code": status,
        "error": {"message": message, "type": kind, "code": status},
    }


def json_response(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def sse(chunks: AsyncIterator[Any]) -> StreamingResponse:
    """Server-sent events; a request that fails mid-stream ends with an error event and [DONE]."""

    async def body():
        try:
            async for chunk in chunks:
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
            yield b"data: [DONE]\n\n"
        except RequestError as exc:
            yield b"data: " + orjson.dumps(error_body(str(exc), exc.status)) + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:  # a disconnected client cancels us here: close the chain so the request aborts
            await chunks.aclose()

    return StreamingResponse(body(), media_type="text/event-stream")


def sse_events(
    events: AsyncIterator[dict], error_event: Callable[[str, int], dict]
) -> StreamingResponse:
    """Server-sent events named by each event's `type` (the Responses and Anthropic streams,
    which end without `[DONE]`); a request that fails mid-stream ends with `error_event`'s."""

    async def body():
        try:
            async for event in events:
                yield _named_event(event)
        except RequestError as exc:
            yield _named_event(error_event(str(exc), exc.status))
        finally:
            await events.aclose()

    return StreamingResponse(body(), media_type="text/event-stream")


def _named_event(event: dict) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def on_request_error(_: Request, exc: RequestError):
        return error_response(str(exc), exc.status, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError):
        parts = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
            parts.append(f"{where}: {err.get('msg')}")
        return error_response("invalid request: " + "; ".join(parts[:5]), 400)


def auth_dependency(api_key: str | None):
    """A global dependency, not an HTTP middleware: BaseHTTPMiddleware hides client disconnects.
    It also refuses requests a web page of another origin sends (a browser names that page in
    `Origin`): with CORS off they have no business here, and without a key they could drive the
    server from any site."""

    async def check_key(request: Request) -> None:
        origin = request.headers.get("origin")
        if origin is not None and urlsplit(origin).netloc != request.headers.get("host"):
            raise RequestError(f"cross-origin requests are refused (Origin {origin!r})", 403)
        if not api_key or request.url.path in OPEN_PATHS or request.method == "OPTIONS":
            return
        bearer = request.headers.get("authorization", "") == f"Bearer {api_key}"
        if not bearer and request.headers.get("x-api-key") != api_key:  # Anthropic's header
            raise RequestError(
                "missing or wrong API key (send 'Authorization: Bearer <key>' or 'x-api-key')", 401
            )

    return check_key
