"""`GET /status`: a read-only status page. The page itself holds no data; its script asks for an admin key,
keeps it in the tab's sessionStorage and polls /v1/stats and /v1/stats/live with it."""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter(tags=["status"])

# Everything is inline (no build step, nothing fetched from elsewhere), so only inline code may run.
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",
}


@router.get("/status", response_class=HTMLResponse, include_in_schema=False)
def status_page() -> HTMLResponse:
    return HTMLResponse((files("api.ops") / "static" / "status.html").read_text(encoding="utf-8"), headers=_HEADERS)
