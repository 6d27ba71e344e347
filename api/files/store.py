"""The bytes of the Files API on disk (docs/architecture.md §15).

A file is stored as `<KEVLAYA_BATCH__FILES_DIR>/<its id in hex>`: the path never comes from the client (an upload named
`../../x` or holding NUL bytes is only a display name in the `files` row). Every file is written under `tmp/`
first, flushed, then renamed into place, so a stored file is always whole; the row is committed after the rename,
and a file left without a row by a process that died between the two is removed by `remove_orphans`."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, BinaryIO

from fastapi import Depends, Request


class TooLarge(ValueError):
    """The content is over a limit: bytes or lines (the message says which)."""


@dataclass(frozen=True)
class Received:
    path: Path  # under tmp/, until `keep` moves it into place
    bytes: int
    lines: int  # lines holding anything but whitespace


def count_lines(chunk: bytes, open_line: bool) -> tuple[int, bool]:
    """Non-blank lines that end in `chunk`, and whether the line still open at its end holds anything but
    whitespace (`open_line`: the same for the line open before it)."""
    *ended, rest = chunk.split(b"\n")
    count = 0
    for part in ended:
        count += open_line or bool(part.strip())
        open_line = False
    return count, open_line or bool(rest.strip())


class Incoming:
    """A file being written under tmp/ as its bytes arrive, counted: past `max_bytes` or `max_lines` it raises
    `TooLarge` before writing the chunk that passes."""

    def __init__(self, path: Path, out: BinaryIO, max_bytes: int, max_lines: int | None):
        self.path, self.out, self.max_bytes, self.max_lines = path, out, max_bytes, max_lines
        self.bytes, self.lines, self.open_line = 0, 0, False

    def write(self, chunk: bytes) -> None:
        if self.bytes + len(chunk) > self.max_bytes:
            raise TooLarge(f"file: over the limit of {self.max_bytes} bytes")
        ended, open_line = count_lines(chunk, self.open_line)
        if self.max_lines is not None and self.lines + ended + open_line > self.max_lines:
            raise TooLarge(f"file: over the limit of {self.max_lines} lines")
        self.out.write(chunk)
        self.bytes += len(chunk)
        self.lines, self.open_line = self.lines + ended, open_line

    def finish(self) -> Received:
        """Flushed to disk and closed: ready for `FileStore.keep`."""
        self.out.flush()
        os.fsync(self.out.fileno())
        self.out.close()
        return Received(self.path, self.bytes, self.lines + self.open_line)

    def discard(self) -> None:
        self.out.close()
        self.path.unlink(missing_ok=True)


class FileStore:
    def __init__(self, root: Path):
        self.root = root
        self.tmp = root / "tmp"

    def path(self, file_id: uuid.UUID) -> Path:
        return self.root / file_id.hex

    def _ready(self) -> None:
        self.tmp.mkdir(parents=True, exist_ok=True)

    @contextmanager
    def writing(self) -> Iterator[tuple[Path, BinaryIO]]:
        """A new file under tmp/; it is removed if the block fails."""
        self._ready()
        path = self.tmp / uuid.uuid4().hex
        try:
            with path.open("xb") as out:
                yield path, out
                out.flush()
                os.fsync(out.fileno())
        except BaseException:
            path.unlink(missing_ok=True)
            raise

    def incoming(self, max_bytes: int, max_lines: int | None) -> Incoming:
        """A new file under tmp/ that an upload writes as it arrives (the caller discards or finishes it)."""
        self._ready()
        path = self.tmp / uuid.uuid4().hex
        return Incoming(path, path.open("xb"), max_bytes, max_lines)

    def keep(self, temporary: Path, file_id: uuid.UUID) -> None:
        os.replace(temporary, self.path(file_id))
        directory = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename survives a crash before the row is committed
        finally:
            os.close(directory)

    def remove(self, file_id: uuid.UUID) -> None:
        self.path(file_id).unlink(missing_ok=True)

    def remove_orphans(self, known: set[uuid.UUID], older_than_s: float) -> int:
        """Remove stored files no row names and temporary files, once older than `older_than_s`."""
        if not self.root.is_dir():
            return 0
        cutoff, removed = time.time() - older_than_s, 0
        for path in [*self.root.iterdir(), *(self.tmp.iterdir() if self.tmp.is_dir() else [])]:
            if not path.is_file() or path.stat().st_mtime > cutoff:
                continue
            try:
                stored = uuid.UUID(hex=path.name) if path.parent == self.root else None
            except ValueError:
                stored = None
            if path.parent == self.root and (stored is None or stored in known):
                continue
            path.unlink(missing_ok=True)
            removed += 1
        return removed


async def get_file_store(request: Request) -> FileStore:
    return request.app.state.file_store


FileStoreDep = Annotated[FileStore, Depends(get_file_store)]
