"""One error shape for every 4xx/5xx: {"error": {"code", "message", "fields"?}}."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy import exc as sa_exc
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

log = logging.getLogger("kevlaya.api")

# How long a client should wait before retrying when a dependency (database, queue) is down.
RETRY_AFTER_S = "5"


class ApiError(Exception):
    def __init__(self, status_code: int, code: str, message: str, headers: dict[str, str] | None = None,
                 fields: list[dict[str, str]] | None = None):
        super().__init__(message)
        self.status_code, self.code, self.message, self.headers = status_code, code, message, headers
        self.fields = fields  # [{field, message}]: the request's fields the error is about, as a 422's

    def __reduce__(self) -> tuple[type[ApiError], tuple[Any, ...]]:
        # pickled whole: the job writer's process sends its errors to the API (api/jobs/writer_process.py)
        return ApiError, (self.status_code, self.code, self.message, self.headers, self.fields)


def unauthorized(message: str) -> ApiError:
    return ApiError(401, "unauthorized", message, headers={"WWW-Authenticate": "Bearer"})


class FieldError(BaseModel):
    field: str
    message: str


class ErrorDetail(BaseModel):
    code: str
    message: str
    fields: list[FieldError] | None = None


class ErrorResponse(BaseModel):
    """The body of every 4xx and 5xx answer."""

    error: ErrorDetail


_STATUS_TEXT = {
    400: "Malformed request (e.g. a body that is not JSON, a cursor this API did not issue)",
    401: "Missing, unknown or revoked API key",
    403: "The key is valid but not an admin key",
    404: "No such job, file or batch visible to this key",
    405: "Method not allowed on this path (see the Allow header)",
    409: "The state of the job, file or batch does not allow this",
    413: "Request body, or a stored file, over the configured limit, or over the key's stored-bytes quota",
    422: "Invalid request; the message names the field",
    429: "This key's rate limit is used up, it holds its most event streams or long-polls, or its most queued jobs "
         "(see Retry-After)",
    500: "Unexpected server error",
    503: "The database or the job queue is unavailable (see Retry-After)",
    504: "The job did not finish in time; it goes on",
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses=` entries for the given error statuses, all with the one error schema."""
    return {code: {"model": ErrorResponse, "description": _STATUS_TEXT[code]} for code in codes}


# Every route may answer these: a broken server (500) and a database that is down (503).
COMMON_ERRORS = (500, 503)
# Every authenticated route: no key (401), over its rate limit (429).
AUTH_ERRORS = (401, 429, *COMMON_ERRORS)


def error_body(code: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, **extra}}


def _field_path(loc: tuple[Any, ...]) -> str:
    # Drop "body" and pydantic's union-branch tags ("str", "MessagesInput", "literal[...]") so the path reads like
    # the JSON.
    parts = [str(p) for p in loc if p != "body" and not (isinstance(p, str) and p[:1].isupper()) and p != "str"
             and not (isinstance(p, str) and p.startswith(("list[", "function-", "literal[")))]
    return ".".join(parts) or "body"


def validation_error_body(errors: list[Any]) -> dict[str, Any]:
    """The 422 body for pydantic's errors: each field's path as in the JSON, and one message naming them all."""
    fields = []
    for err in errors:
        if err.get("type") == "json_invalid":  # its location is a character position, not a field
            detail = err.get("ctx", {}).get("error", "")
            fields.append({"field": "body", "message": f"not valid JSON at character {err['loc'][-1]}: {detail}"})
            continue
        message = err["msg"]
        if err.get("type") == "extra_forbidden":
            message = "not a parameter this server takes (refused rather than ignored)"
        fields.append({"field": _field_path(tuple(err["loc"])), "message": message})
    # A str|object union reports one error per branch; keep each field's messages once.
    message = "; ".join(dict.fromkeys(f"{f['field']}: {f['message']}" for f in fields))
    return error_body("invalid_request", message, fields=fields)


async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse(status_code=422, content=validation_error_body(list(exc.errors())))


async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
    extra = {"fields": exc.fields} if exc.fields else {}
    return JSONResponse(status_code=exc.status_code, content=error_body(exc.code, exc.message, **extra),
                        headers=exc.headers)


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route serves on this path (Starlette's own 405 names only the first route's).
    Asked through each route's public `matches`, since included routers nest their routes."""
    routes = request.app.router.routes
    return [method for method in _METHODS
            if any(route.matches({**request.scope, "method": method})[0] == Match.FULL for route in routes)]


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {400: "bad_request", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    headers = dict(exc.headers or {})
    message = str(exc.detail)
    if exc.status_code == 405:
        allowed = _allowed_methods(request)
        headers["Allow"] = ", ".join(allowed)
        message = f"{request.method} is not allowed here; allowed: {', '.join(allowed)}"
    return JSONResponse(status_code=exc.status_code, content=error_body(code, message), headers=headers)


def database_unavailable(exc: BaseException) -> bool:
    # OperationalError covers "cannot connect", "server closed the connection", "database is locked";
    # a dropped connection can also surface as InterfaceError or an invalidated connection.
    return isinstance(exc, sa_exc.TimeoutError) or (isinstance(exc, sa_exc.DBAPIError) and (
        isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError)) or exc.connection_invalidated))


def _unavailable_error() -> ApiError:
    return ApiError(503, "database_unavailable", "the database is unavailable; retry later",
                    headers={"Retry-After": RETRY_AFTER_S})


def _internal_error() -> ApiError:
    return ApiError(500, "internal", "internal server error")


def as_api_error(exc: BaseException) -> ApiError:
    """The answer an exception gets, as the handlers below would give it (for errors raised in another process)."""
    if isinstance(exc, ApiError):
        return exc
    return _unavailable_error() if database_unavailable(exc) else _internal_error()


async def _database_error(request: Request, exc: Exception) -> JSONResponse:
    if database_unavailable(exc):
        # The driver's message names hosts and ports: it goes to the log, not to the client.
        log.error("database unavailable during %s %s: %s", request.method, request.url.path, exc)
        return await _api_error(request, _unavailable_error())
    return await _unexpected_error(request, exc)


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    log.error("unexpected error during %s %s", request.method, request.url.path, exc_info=exc)
    return await _api_error(request, _internal_error())


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(sa_exc.SQLAlchemyError, _database_error)
    # Anything else: still the JSON error shape, never Starlette's text/plain 500.
    app.add_exception_handler(Exception, _unexpected_error)
