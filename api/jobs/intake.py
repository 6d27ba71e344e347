"""What the submit routes need of their app, as one dependency: the limits a request is checked against and
the process's job writer that stores it (one dependency, not three: FastAPI resolves each one per request)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from api.http.errors import ApiError
from api.jobs.prompt_budget import JOB_FIELDS, FieldNames, PromptBudget
from api.jobs.submission import Accepted
from api.jobs.writer import JobWriter
from api.jobs.writer_process import WriterProcess
from api.keys.rate import charge_jobs
from shared.adapter_assignments import is_role
from shared.db import session_scope
from shared.models import ApiKey
from shared.schemas import JobCreate
from shared.settings import ADAPTERS, Settings


def not_a_role(field: str, name: str) -> ApiError:
    return ApiError(422, "invalid_request", f"{field}: {name!r} is not a role of this service: kev, laya, auto, or "
                    "one loaded at run time (GET /v1/models lists them)")


class Roles:
    """Which names are roles: kev, laya, auto, and those loaded at run time under new names. A name once loaded
    stays a role (unloaded, its submits are refused by the writer, 503), so what was found is kept; a name not
    found is looked up again each time, and a role just loaded is taken at once."""

    def __init__(self) -> None:
        self.known = {*ADAPTERS, "auto"}

    def __contains__(self, name: str) -> bool:
        if name not in self.known:
            with session_scope() as session:
                if is_role(session, name):
                    self.known.add(name)
        return name in self.known


@dataclass(frozen=True)
class Intake:
    settings: Settings
    budget: PromptBudget | None  # None: the tokenizer could not be read, prompts are not counted (logged)
    writer: JobWriter | WriterProcess  # KEVLAYA_API__WRITER: a thread of this process, or a process of its own
    roles: Roles = field(default_factory=Roles)

    def check(self, request: JobCreate, field_prefix: str = "", names: FieldNames = JOB_FIELDS) -> None:
        """422 naming the field when the request names no role or is over a limit (characters, new tokens, the
        context)."""
        settings = self.settings
        if request.adapter not in self.roles:
            raise not_a_role(f"{field_prefix}{names.adapter}", request.adapter)
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
