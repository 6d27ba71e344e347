"""Reading a batch's input file (docs/architecture.md §15): one request per line, streamed, never held whole.

A line is `{"custom_id", "method": "POST", "url", "body"}`. What makes the file unreadable as a batch (a line
that is not a JSON object of that shape, a repeated `custom_id`, a `url` other than the batch's endpoint, no
request at all) fails the whole batch before any line is stored: `MalformedFile`, with each line's error. A body the
endpoint (chat completions, or responses) would refuse is that line's error alone: it is answered in the error file
with the status and error body the live endpoint would have given, and the other lines run."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from pydantic import ValidationError

from api.http.errors import ApiError, validation_error_body
from api.jobs.prompt_budget import FieldNames
from api.openai.chat.schemas import CHAT_FIELDS, ChatRequest
from api.openai.responses.schemas import ENDPOINT as RESPONSES
from api.openai.responses.schemas import RESPONSES_FIELDS, ResponseJob, ResponsesRequest
from shared.schemas import JobCreate

MAX_CUSTOM_ID = 512
MAX_FILE_ERRORS = 100  # a malformed file reports this many of its lines at most
_ENVELOPE = {"custom_id", "method", "url", "body"}


@dataclass(frozen=True)
class Request:
    line: int  # from 1
    custom_id: str
    job: JobCreate


@dataclass(frozen=True)
class Rejected:
    line: int
    custom_id: str
    status_code: int
    error: dict[str, Any]  # {"code", "message", ...}: the live endpoint's error body


class MalformedFile(ValueError):
    def __init__(self, errors: list[dict[str, Any]]):
        super().__init__("; ".join(f"line {e['line']}: {e['message']}" if e.get("line") else e["message"]
                                   for e in errors[:3]))
        self.errors = errors


def _skip_rest_of_line(source: BinaryIO) -> None:
    """Read past the end of the current line a chunk at a time: it may be as large as the file."""
    while more := source.readline(1024 * 1024):
        if more.endswith(b"\n"):
            return


def _lines(source: BinaryIO, max_line_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """(number, bytes) of each non-blank line; None for a line over `max_line_bytes`, which is skipped unread."""
    number = 0
    while True:
        raw = source.readline(max_line_bytes + 1)
        if not raw:
            return
        number += 1
        if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
            _skip_rest_of_line(source)
            yield number, None
        elif raw.strip():
            yield number, raw


def _envelope(raw: bytes, endpoint: str) -> tuple[str, dict[str, Any]]:
    """The line's custom_id and body; ValueError naming what is wrong."""
    try:
        line = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a JSON object: {exc}") from None
    if not isinstance(line, dict):
        raise ValueError("not a JSON object")
    if unknown := sorted(set(line) - _ENVELOPE):
        raise ValueError(f"{', '.join(unknown)}: not a field of a batch line (custom_id, method, url, body)")
    if missing := sorted(_ENVELOPE - set(line)):
        raise ValueError(f"{', '.join(missing)}: missing")
    custom_id = line["custom_id"]
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        raise ValueError(f"custom_id: a string of 1 to {MAX_CUSTOM_ID} characters")
    if line["method"] != "POST":
        raise ValueError("method: only POST")
    if line["url"] != endpoint:
        raise ValueError(f"url: {line['url']!r} is not the batch's endpoint {endpoint}")
    if not isinstance(line["body"], dict):
        raise ValueError("body: not a JSON object")
    return custom_id, line["body"]


def check_file(path: Path, endpoint: str, max_line_bytes: int) -> int:
    """The number of requests in the file at `path`; `MalformedFile` when it cannot be read as a batch."""
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    count = 0

    def fail(line: int, code: str, message: str) -> None:
        if len(errors) < MAX_FILE_ERRORS:
            errors.append({"code": code, "message": message, "line": line})

    with path.open("rb") as source:
        for number, raw in _lines(source, max_line_bytes):
            count += 1
            if raw is None:
                fail(number, "line_too_large", f"over {max_line_bytes} bytes, the request body limit")
                continue
            try:
                custom_id, _body = _envelope(raw, endpoint)
            except ValueError as exc:
                fail(number, "invalid_request_line", str(exc))
                continue
            if custom_id in seen:
                fail(number, "duplicate_custom_id", f"custom_id {custom_id!r} is on an earlier line")
            seen.add(custom_id)
    if count == 0:
        errors.append({"code": "empty_file", "message": "the file holds no request", "line": None})
    if errors:
        raise MalformedFile(errors)
    return count


def read_requests(path: Path, endpoint: str, check: Callable[[JobCreate], None], max_line_bytes: int,
                  after_line: int = 0) -> Iterator[Request | Rejected]:
    """Each line after `after_line` of a file `check_file` passed, as a request to run or a rejected line, in
    order. `check` applies the live endpoint's limits (it raises ApiError)."""
    with path.open("rb") as source:
        for number, raw in _lines(source, max_line_bytes):
            if number > after_line and raw is not None:
                custom_id, body = _envelope(raw, endpoint)
                yield _request(number, custom_id, body, check, endpoint)


def fields_of(job: JobCreate) -> FieldNames:
    """How a line's request names its fields, for the limits the live endpoint checks."""
    return RESPONSES_FIELDS if isinstance(job, ResponseJob) else CHAT_FIELDS


def _job(body: dict[str, Any], endpoint: str) -> JobCreate:
    """The line's job; ValidationError, or ApiError naming what a line cannot ask."""
    if endpoint == RESPONSES:
        request = ResponsesRequest.model_validate(body)
        for field in ("stream", "background", "previous_response_id"):
            if getattr(request, field):
                raise ApiError(422, "invalid_request", f"{field}: not in a batch line (its answer goes to the "
                               "output file; a line continues no response)")
        return request.to_job([])
    chat = ChatRequest.model_validate(body)
    if chat.stream:
        raise ApiError(422, "invalid_request", "stream: a batch line cannot stream; its answer goes to the output file")
    return chat.to_job()


def _request(number: int, custom_id: str, body: dict[str, Any], check: Callable[[JobCreate], None],
             endpoint: str) -> Request | Rejected:
    try:
        job = _job(body, endpoint)
        check(job)
    except ValidationError as exc:
        return Rejected(number, custom_id, 422, validation_error_body(list(exc.errors()))["error"])
    except ApiError as exc:
        return Rejected(number, custom_id, exc.status_code, {"code": exc.code, "message": exc.message})
    return Request(number, custom_id, job)
