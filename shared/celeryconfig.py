"""Celery configuration, built from the settings when the Celery app is built (`shared/queue.py: celery_app`),
never at import. Why each value: docs/architecture.md §3 and §11."""

from __future__ import annotations

from typing import Any

from shared.settings import Settings


def celery_config(settings: Settings) -> dict[str, Any]:
    return {
        "broker_url": settings.redis.url,
        # The jobs table is the status of record; Celery results would only grow Redis.
        "task_ignore_result": True,
        "result_backend": None,
        "task_default_queue": "kevlaya.jobs",
        "task_serializer": "json",
        "accept_content": ["json"],
        # One GPU job stream: take one message at a time, ack only after results are committed,
        # and give the message back if the worker process dies mid-batch.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "worker_concurrency": 1,
        "worker_pool": "prefork",
        # Every wake-up is a task and a restart reloads the model, so recycling is opt-in.
        "worker_max_tasks_per_child": settings.reliability.worker_recycle_after_tasks,
        # The model is loaded in each new pool child before it reports up; Celery kills a child that takes longer
        # than this (4 s by default), and a replacement child that can never load in time is killed forever.
        "worker_proc_alive_timeout": settings.reliability.model_load_timeout_s,
        "task_time_limit": settings.reliability.job_time_limit_s,
        "task_soft_time_limit": max(settings.reliability.job_time_limit_s - 30, 5),
        # Redis re-delivers an unacked message after the visibility timeout: keep it above the longest task.
        "broker_transport_options": {"visibility_timeout": settings.reliability.visibility_timeout_s},
        "result_backend_transport_options": {"visibility_timeout": settings.reliability.visibility_timeout_s},
        "broker_connection_retry_on_startup": True,
        "worker_send_task_events": True,  # Flower
        "task_send_sent_event": True,
    }
