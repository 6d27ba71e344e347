"""Publishing wake-up messages. A message carries a job id and its adapter, never the prompt:
the `jobs` row is the source of truth and the worker claims work from the database."""

from __future__ import annotations

import uuid
from functools import lru_cache

import redis
from celery import Celery

from shared.celeryconfig import celery_config
from shared.settings import get_settings

RUN_TASK = "kevlaya.run_queued"


class QueueUnavailable(RuntimeError):
    """The broker could not take the message."""


@lru_cache
def celery_app() -> Celery:
    """The Celery app, configured from the settings read now (an invalid setting fails here, naming it)."""
    app = Celery("kevlaya")
    app.config_from_object(celery_config(get_settings()))
    return app


def publish_wakeup(job_id: uuid.UUID | None, adapter: str) -> None:
    settings = get_settings()
    try:
        celery_app().send_task(
            RUN_TASK,
            args=[str(job_id) if job_id else None, adapter],
            retry=settings.reliability.publish_retries > 0,
            retry_policy={
                "max_retries": settings.reliability.publish_retries,
                "interval_start": 0,
                "interval_step": 0.2,
                "interval_max": 0.5,
            },
        )
    except Exception as exc:  # kombu raises OperationalError, redis its own ConnectionError
        raise QueueUnavailable(f"message broker unavailable: {exc}") from exc


@lru_cache
def redis_client() -> redis.Redis:
    return redis.Redis.from_url(get_settings().redis.url, socket_timeout=2, socket_connect_timeout=2)


def waiting_wakeups() -> int:
    """Wake-ups in the broker that no worker has taken yet (the queue's Redis list; a message a worker has
    fetched is off it)."""
    return redis_client().llen(celery_app().conf.task_default_queue)


def ping_queue() -> None:
    """The broker answers and takes writes. A write, not a PING: a Redis at `maxmemory` (`noeviction`) still
    answers PING but refuses the wake-up that would follow the commit."""
    try:
        redis_client().set("kevlaya:queue:writable", b"1", ex=60)
    except redis.RedisError as exc:
        raise QueueUnavailable(f"message broker unavailable: {exc}") from exc
