"""What the submit routes need of their app, as one dependency: the limits a request is checked against and
the process's job writer that stores it (one dependency, not three: FastAPI resolves each one per request)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from api.http.errors import ApiError
from api.jobs.prompt_budget import JOB_FIELDS, FieldNames, PromptBudget
from api.jobs.submission import Accepted
from api.jobs.writer import JobWriter
from api.jobs.writer_process import WriterProcess
from api.keys.rate import charge_jobs
from shared.models import ApiKey
from shared.schemas import JobCreate
from shared.settings import Settings


@dataclass(frozen=True)
class Intake:
    settings: Settings
    budget: PromptBudget | None  # None: the tokenizer could not be read, prompts are not counted (logged)
    writer: JobWriter | WriterProcess  # KEVLAYA_API__WRITER: a thread of this process, or a process of its own

    def check(self, request: JobCreate, field_prefix: str = "", names: FieldNames = JOB_FIELDS) -> None:
        """422 naming the field when the request is over a limit (characters, new tokens, the context)."""
        settings = self.settings
        if request.prompt_chars() > settings.limits.prompt_chars:
            raise ApiError(422, "invalid_request",
                           f"{field_prefix}{names.input}: prompt has {request.prompt_chars()} characters, "
                           f"the limit is {settings.limits.prompt_chars}")
        tokens = request.params.max_new_tokens
        if tokens is not None and tokens > settings.limits.max_new_tokens:
            raise ApiError(422, "invalid_request",
                           f"{field_prefix}{names.max_new_tokens}: {tokens} is over the limit of "
                           f"{settings.limits.max_new_tokens}")
        if self.budget is not None:
            self.budget.check(request, field_prefix, names)

    async def store(self, key: ApiKey, requests: list[JobCreate]) -> list[Accepted]:
        await charge_jobs(key, len(requests))  # the key's rate limit counts jobs, not requests
        return await self.writer.store(key, requests)


async def get_intake(request: Request) -> Intake:
    return request.app.state.intake


IntakeDep = Annotated[Intake, Depends(get_intake)]
