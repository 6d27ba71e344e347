"""Builds the FastAPI app: routers, error handlers, the body-size limit."""

from __future__ import annotations

from fastapi import FastAPI

from api.body_limit import BodySizeLimit
from api.docs import install_docs
from api.errors import install_error_handlers
from api.routes import chat, health, jobs
from shared.settings import get_settings


def create_app() -> FastAPI:
    app = FastAPI(
        title="kevlaya",
        version="0.1.0",
        summary="Decision jobs for two LoRA roles (Kev, Laya) on one shared base model.",
        docs_url=None,  # served by install_docs, with local assets
        redoc_url=None,
    )
    install_docs(app)
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(jobs.router)
    app.include_router(chat.router)
    app.add_middleware(BodySizeLimit, max_bytes=get_settings().max_body_bytes)
    return app


app = create_app()
