"""`kevlaya batch`: a JSONL file of chat requests through the Batch API, over HTTP like any other client, so it
works against a local or a remote API."""

from __future__ import annotations

import contextlib
import os
import shlex
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional
from urllib.parse import quote

import typer

from cli.common import fail
from shared.settings import get_settings

if TYPE_CHECKING:
    import httpx

app = typer.Typer(help="Batches of chat requests (OpenAI's Batch API): run a JSONL file, wait for one, cancel one.",
                  no_args_is_help=True)

FINAL = ("completed", "failed", "expired", "cancelled")
TRANSIENT = (429, 502, 503, 504)  # a look at the batch that gets one of these is tried again

Url = Annotated[Optional[str], typer.Option(
    help="the API's base URL (default: http://127.0.0.1:8000, or as KEVLAYA_API__HOST and KEVLAYA_API__PORT say)")]
Key = Annotated[Optional[str], typer.Option(
    help="the API key; every user of the machine sees it in the process list: prefer --key-file or KEVLAYA_API__KEY")]
KeyFile = Annotated[Optional[Path], typer.Option(
    help="a file holding the API key (default: KEVLAYA_API__KEY); readable by you alone, it stays out of the process "
    "list and the shell's history")]
Out = Annotated[Optional[Path], typer.Option(help="where the output file goes (the answered lines)")]
Errors = Annotated[Optional[Path], typer.Option(help="where the error file goes (the lines that got an error)")]
Poll = Annotated[float, typer.Option(min=0.1, help="seconds between two looks at the batch")]
BatchId = Annotated[str, typer.Argument(help="the batch's id (batch_...)")]


# -- talking to the API ----------------------------------------------------------------------------------------

def _key(key: str | None, key_file: Path | None) -> str:
    """--key, else the file's first line, else KEVLAYA_API__KEY."""
    if key:
        return key
    if key_file is not None:
        try:
            lines = key_file.read_text().split()
        except OSError as exc:
            fail(f"--key-file {key_file}: {exc.strerror}")
        if not lines:
            fail(f"--key-file {key_file}: empty")
        return lines[0]
    settings = get_settings()
    if settings.api.key is None:
        fail("no API key: set KEVLAYA_API__KEY or pass --key-file")
    return settings.api.key.get_secret_value()


def _client(url: str | None, key: str | None, key_file: Path | None = None) -> httpx.Client:
    import httpx

    settings = get_settings()
    key = _key(key, key_file)
    if url is None:
        host = "127.0.0.1" if settings.api.host in ("0.0.0.0", "::") else settings.api.host
        url = f"http://{f'[{host}]' if ':' in host else host}:{settings.api.port}"
    try:
        # the timeout is per read or write, not for the whole call: a large upload may take longer
        return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    except httpx.InvalidURL as exc:
        fail(f"--url {url}: {exc}")


@contextmanager
def _reaching(client: httpx.Client) -> Iterator[None]:
    """A connection that fails ends the command with one line, not a traceback."""
    import httpx

    try:
        yield
    except httpx.TransportError as exc:
        fail(f"the API at {client.base_url} did not answer: {exc or type(exc).__name__}")


def _check(response: httpx.Response) -> None:
    """End the command (exit 2) on a refusal, with the API's own `error.message`."""
    if response.is_success:
        return
    response.read()
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:200] or response.reason_phrase
    fail(f"{response.request.method} {response.request.url.path}: {response.status_code} {message}")


def _json(response: httpx.Response) -> dict[str, Any]:
    _check(response)
    try:
        return response.json()
    except ValueError:
        fail(f"{response.request.url} answered {response.headers.get('content-type')}, not JSON: is it the API?")


def _call(client: httpx.Client, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
    with _reaching(client):
        return _json(client.request(method, path, **kwargs))


def _batch_path(batch_id: str) -> str:
    return f"/v1/batches/{quote(batch_id, safe='')}"


def _delete_quietly(client: httpx.Client, file_id: str) -> None:
    import httpx

    with contextlib.suppress(httpx.HTTPError):  # best effort: the upload only counts against the key's quota
        client.delete(f"/v1/files/{quote(file_id, safe='')}")


# -- waiting and downloading -----------------------------------------------------------------------------------

def _look(client: httpx.Client, batch_id: str) -> dict[str, Any] | None:
    """The batch now, or None while the API is briefly away (restarting, its database away, rate limited), so a
    wait of hours outlasts it; Ctrl-C ends a wait on an API that is gone for good."""
    import httpx

    try:
        response = client.get(_batch_path(batch_id))
    except httpx.TransportError:
        return None
    return None if response.status_code in TRANSIENT else _json(response)


def _wait(client: httpx.Client, batch_id: str, poll: float) -> dict[str, Any]:
    """Look at the batch every `poll` seconds until it has ended, with a progress bar once its lines are counted."""
    from tqdm import tqdm

    batch = _call(client, "GET", _batch_path(batch_id))  # a wrong id or URL ends the command here
    bar, shown = None, None
    try:
        while True:
            counts = batch["request_counts"]
            if bar is None and counts["total"]:
                bar = tqdm(total=counts["total"], desc=batch["id"], unit="req")
            done = counts["completed"] + counts["failed"]
            if bar is not None and (done, batch["status"]) != shown:  # redrawn on a change only: short logs
                shown = (done, batch["status"])
                bar.set_postfix_str(batch["status"], refresh=False)
                if done != bar.n:
                    bar.update(done - bar.n)  # through update, so the bar's rate is right
                else:
                    bar.refresh()
            if batch["status"] in FINAL:
                return batch
            time.sleep(poll)
            batch = _look(client, batch_id) or batch
    finally:
        if bar is not None:
            bar.close()


def _download(client: httpx.Client, file_id: str, dest: Path) -> None:
    """Stream the file to a part file beside `dest`, renamed over it once whole: never held in memory, and `dest`
    is never left half written (an interrupted download leaves nothing)."""
    part = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    try:
        with _reaching(client), client.stream("GET", f"/v1/files/{quote(file_id, safe='')}/content") as response:
            _check(response)
            with part.open("wb") as sink:
                for chunk in response.iter_bytes(1024 * 1024):
                    sink.write(chunk)
                sink.flush()
                os.fsync(sink.fileno())
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)


def _finish(client: httpx.Client, batch_id: str, out: Path, errors: Path, poll: float, resume: list[str]) -> None:
    """Wait for the batch, download its files and say how it ended; exits 0 when it completed, 1 otherwise.
    Ctrl-C leaves the batch running and says how to go on waiting."""
    try:
        batch = _wait(client, batch_id, poll)
        saved = {}
        for field, dest, name in (("output_file_id", out, "output"), ("error_file_id", errors, "errors")):
            if batch[field]:
                _download(client, batch[field], dest)
            saved[name] = str(dest) if batch[field] else "none"
    except KeyboardInterrupt:
        typer.echo(f"\ninterrupted; batch {batch_id} goes on. To wait for it again: {shlex.join(resume)}", err=True)
        raise typer.Exit(130) from None
    counts = batch["request_counts"]
    typer.echo(f"{batch['id']} {batch['status']}: {counts['total']} requests, {counts['completed']} completed, "
               f"{counts['failed']} failed; output: {saved['output']}, errors: {saved['errors']}")
    if batch["status"] == "failed":
        for error in (batch.get("errors") or {}).get("data", []):
            where = f"line {error['line']}: " if error.get("line") else ""
            typer.echo(f"  {where}{error['message']} ({error['code']})", err=True)
    raise typer.Exit(0 if batch["status"] == "completed" else 1)


# -- checking arguments before anything is sent ----------------------------------------------------------------

def _check_window(window: str) -> None:
    from api.batch.schemas import completion_window  # what POST /v1/batches takes

    try:
        completion_window(window)
    except ValueError as exc:
        fail(f"--window: {exc}")


def _check_destinations(out: Path, errors: Path) -> None:
    if out.resolve() == errors.resolve():
        fail(f"--out and --errors are the same file: {out}")
    for option, path in (("--out", out), ("--errors", errors)):
        if path.is_dir():
            fail(f"{option} {path}: a directory, not a file")
        if not path.parent.is_dir():
            fail(f"{option} {path}: no directory {path.parent}")


def _resume(batch_id: str, url: str | None, out: Path, errors: Path) -> list[str]:
    """The `kevlaya batch wait` command that goes on where this one stopped, from any directory (the key is left
    out: it is secret)."""
    return ["kevlaya", "batch", "wait", batch_id, *(["--url", url] if url else []), "--out", os.path.abspath(out),
            "--errors", os.path.abspath(errors)]


# -- the commands ----------------------------------------------------------------------------------------------

@app.command("run")
def batch_run(
    file: Annotated[Path, typer.Argument(
        help="JSONL, one request a line: {custom_id, method: POST, url: /v1/chat/completions, body}")],
    url: Url = None,
    key: Key = None,
    key_file: KeyFile = None,
    window: Annotated[str, typer.Option(help="the completion window: lines not run by then expire (1s to 7d)")]
    = "24h",
    out: Out = None,
    errors: Errors = None,
    poll: Poll = 1.0,
) -> None:
    """Upload FILE, run it as a batch and download its results.

    Shows a progress bar, then writes the output and error files (by default FILE with the suffix .output.jsonl
    and .errors.jsonl). Exits 0 when the batch completed, 1 when it failed, expired or was cancelled, 2 on bad
    arguments or a refusal by the API; Ctrl-C leaves the batch running (exit 130)."""
    if not file.is_file():
        fail(f"{file}: {'not a file' if file.exists() else 'no such file'}")
    _check_window(window)
    out = out or file.with_suffix(".output.jsonl")
    errors = errors or file.with_suffix(".errors.jsonl")
    _check_destinations(out, errors)
    with _client(url, key, key_file) as client:
        with file.open("rb") as source:
            uploaded = _call(client, "POST", "/v1/files", data={"purpose": "batch"},
                             files={"file": (file.name, source, "application/jsonl")})
        try:
            batch = _call(client, "POST", "/v1/batches", json={
                "input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions", "completion_window": window})
        except typer.Exit:
            _delete_quietly(client, uploaded["id"])  # a file no batch reads would only count against the key
            raise
        typer.echo(f"{batch['id']}: {file} uploaded as {uploaded['id']}", err=True)
        _finish(client, batch["id"], out, errors, poll, _resume(batch["id"], url, out, errors))


@app.command("wait")
def batch_wait(
    batch_id: BatchId,
    url: Url = None,
    key: Key = None,
    key_file: KeyFile = None,
    out: Out = None,
    errors: Errors = None,
    poll: Poll = 1.0,
) -> None:
    """Wait for a batch and download its results.

    Shows a progress bar, then writes the output and error files (by default BATCH_ID.output.jsonl and
    BATCH_ID.errors.jsonl). Exits as `kevlaya batch run` does."""
    out = out or Path(f"{batch_id}.output.jsonl")
    errors = errors or Path(f"{batch_id}.errors.jsonl")
    _check_destinations(out, errors)
    with _client(url, key, key_file) as client:
        _finish(client, batch_id, out, errors, poll, _resume(batch_id, url, out, errors))


@app.command("cancel")
def batch_cancel(batch_id: BatchId, url: Url = None, key: Key = None, key_file: KeyFile = None) -> None:
    """Cancel a batch and print its new status.

    Its queued lines are not run; lines already running finish: the batch is `cancelling` until they have, then
    `cancelled` (`kevlaya batch wait` downloads what they answered)."""
    with _client(url, key, key_file) as client:
        batch = _call(client, "POST", f"{_batch_path(batch_id)}/cancel")
    typer.echo(f"{batch['id']} {batch['status']}")
