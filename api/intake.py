"""What the submit routes need of their app, as one dependency: the limits a request is checked against and
the process's job writer that stores it (one dependency, not three: FastAPI resolves each one per request)."""

from __future__ import annotations

from dataclasses import dataclass

from api.job_writer import JobWriter
from api.prompt_budget import JOB_FIELDS, FieldNames, PromptBudget
from api.submission import Stored, check_limits
from shared.models import ApiKey
from shared.schemas import JobCreate
from shared.settings import Settings


@dataclass(frozen=True)
class Intake:
    settings: Settings
    budget: PromptBudget | None  # None: the tokenizer could not be read, prompts are not counted (logged)
    writer: JobWriter

    def check(self, request: JobCreate, field_prefix: str = "", names: FieldNames = JOB_FIELDS) -> None:
        """422 naming the field when the request is over a limit (characters, new tokens, the context)."""
        check_limits(request, self.settings, self.budget, field_prefix, names)

    async def store(self, key: ApiKey, requests: list[JobCreate]) -> list[Stored]:
        return await self.writer.store(key, requests)
