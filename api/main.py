"""Builds the FastAPI app: routers, error handlers, the body-size limit."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from api.body_limit import BodySizeLimit
from api.errors import install_error_handlers
from api.routes import chat, health, jobs
from api.waiting import notices
from shared.settings import get_settings


@asynccontextmanager
async def _lifespan(_app: FastAPI) -> AsyncIterator[None]:
    yield
    await notices.close()  # the long-polls' Redis subscription


def create_app() -> FastAPI:
    app = FastAPI(
        lifespan=_lifespan,
        title="kevlaya",
        version="0.1.0",
        summary="Decision jobs for two LoRA roles (Kev, Laya) on one shared base model.",
    )
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(jobs.router)
    app.include_router(chat.router)
    app.add_middleware(BodySizeLimit, max_bytes=get_settings().max_body_bytes)
    return app


app = create_app()
