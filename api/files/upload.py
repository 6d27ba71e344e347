"""A multipart upload read as it arrives (docs/architecture.md §15): small text fields kept in memory, the one file
part handed to a sink chunk by chunk, so its bytes go straight to where they are kept and a sink that refuses
them (a limit, a quota, a full disk) stops the upload there. Nothing is spooled to the system's temporary
directory, as Starlette's form parser would."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from fastapi.concurrency import run_in_threadpool
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request

from api.http.errors import ApiError

MAX_FIELD_BYTES = 1024  # a text field (purpose, expiry) is a word or a number


class Sink(Protocol):
    def write(self, data: bytes) -> None: ...


@dataclass
class Form:
    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None  # as the client named it (shown back only once cleaned)
    has_file: bool = False


@dataclass
class _Part:
    name: str = ""
    is_file: bool = False
    disposition: bytes = b""
    header_name: bytes = b""
    header_value: bytes = b""
    data: bytearray = field(default_factory=bytearray)


class _Parser:
    def __init__(self, names: tuple[str, ...], file_field: str, open_sink: Callable[[], Sink]):
        self.names, self.file_field, self.open_sink = names, file_field, open_sink
        self.form = Form()
        self.part = _Part()
        self.sink: Sink | None = None
        self.pending = bytearray()  # file bytes parsed from the last chunk, written outside the event loop

    def on_part_begin(self) -> None:
        self.part = _Part()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self.part.header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self.part.header_value += data[start:end]

    def on_header_end(self) -> None:
        if self.part.header_name.lower() == b"content-disposition":
            self.part.disposition = self.part.header_value
        self.part.header_name, self.part.header_value = b"", b""

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self.part.disposition)
        name = options.get(b"name", b"").decode("utf-8", "replace")
        if name not in self.names:
            raise ApiError(422, "invalid_request", f"{name or 'a part without a name'}: not a field this server "
                           f"takes (refused rather than ignored); it takes {', '.join(self.names)}")
        if name in self.form.fields or (name == self.file_field and self.form.has_file):
            raise ApiError(422, "invalid_request", f"{name}: given twice")
        self.part.name = name
        self.part.is_file = b"filename" in options
        if name == self.file_field:
            if not self.part.is_file:
                raise ApiError(422, "invalid_request", f"{name}: missing, or not a file part")
            self.form.has_file = True
            self.form.filename = options[b"filename"].decode("utf-8", "replace")
            self.sink = self.open_sink()
        elif self.part.is_file:
            raise ApiError(422, "invalid_request", f"{name}: a text field, not a file")

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self.part.name == self.file_field:
            self.pending += data[start:end]
            return
        self.part.data += data[start:end]
        if len(self.part.data) > MAX_FIELD_BYTES:
            raise ApiError(422, "invalid_request", f"{self.part.name}: longer than {MAX_FIELD_BYTES} bytes")

    def on_part_end(self) -> None:
        if self.part.name != self.file_field:
            self.form.fields[self.part.name] = self.part.data.decode("utf-8", "replace")


async def read_form(request: Request, names: tuple[str, ...], file_field: str, open_sink: Callable[[], Sink]) -> Form:
    """Read a multipart/form-data body: each field in `names` at most once, `file_field` a file whose bytes go to
    the sink `open_sink` makes when the part starts. What the sink raises stops the reading (the rest of the body
    is never read); so does a malformed body (400) or an unknown field (422)."""
    _, params = parse_options_header(request.headers.get("content-type", ""))
    boundary = params.get(b"boundary")
    if not boundary:
        raise ApiError(400, "invalid_request", "body: multipart/form-data without a boundary")
    parser = _Parser(names, file_field, open_sink)
    callbacks = {name: getattr(parser, name) for name in (
        "on_part_begin", "on_part_data", "on_part_end", "on_header_field", "on_header_value", "on_header_end",
        "on_headers_finished")}  # callbacks are optional: the end of the body needs none
    multipart = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]
    try:
        async for chunk in request.stream():
            multipart.write(chunk)
            if parser.pending:
                data, parser.pending = bytes(parser.pending), bytearray()
                await run_in_threadpool(parser.sink.write, data)  # type: ignore[union-attr]
        multipart.finalize()
        if parser.pending:
            await run_in_threadpool(parser.sink.write, bytes(parser.pending))  # type: ignore[union-attr]
    except MultipartParseError as exc:
        raise ApiError(400, "invalid_request", f"body: malformed multipart/form-data ({exc})") from None
    return parser.form
