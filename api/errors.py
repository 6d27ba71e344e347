"""One error shape for every 4xx/5xx: {"error": {"code", "message", "fields"?}}."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class ApiError(Exception):
    def __init__(self, status_code: int, code: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status_code, self.code, self.message, self.headers = status_code, code, message, headers


def error_body(code: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, **extra}}


def _field_path(loc: tuple[Any, ...]) -> str:
    # Drop "body" and pydantic's union-branch tags ("str", "MessagesInput") so the path reads like the JSON.
    parts = [str(p) for p in loc if p != "body" and not (isinstance(p, str) and p[:1].isupper()) and p != "str"]
    return ".".join(parts) or "body"


async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    fields = []
    for err in exc.errors():
        fields.append({"field": _field_path(tuple(err["loc"])), "message": err["msg"]})
    # A str|object union reports one error per branch; keep each field's messages once.
    message = "; ".join(dict.fromkeys(f"{f['field']}: {f['message']}" for f in fields))
    return JSONResponse(status_code=422, content=error_body("invalid_request", message, fields=fields))


async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(status_code=exc.status_code, content=error_body(exc.code, exc.message), headers=exc.headers)


async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return JSONResponse(status_code=exc.status_code, content=error_body(code, str(exc.detail)), headers=exc.headers)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
