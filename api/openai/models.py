"""`GET /v1/models`: the model names chat completions accept, in OpenAI's list format; each adapter with the version
a worker loaded last (docs/architecture.md §10), roles loaded at run time under new names included. An unloaded
role is not listed, and neither is `auto` while Laya, its first stage, is unloaded."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from api.http.deps import SessionDep, reject_unknown_query_parameters
from api.http.errors import AUTH_ERRORS, error_responses
from api.keys.auth import CurrentKey
from shared.adapter_assignments import new_roles, unloaded_roles
from shared.adapter_versions import last_loaded
from shared.models import AdapterVersion
from shared.settings import ADAPTERS

router = APIRouter(prefix="/v1/models", tags=["chat"], dependencies=[Depends(reject_unknown_query_parameters)])


class ModelVersion(BaseModel):
    """Not in OpenAI's schema (clients ignore it): the adapter version a worker loaded last."""

    adapter_version: str = Field(description="the sha256 of its config and weights, as jobs record it")
    base: str = Field(description="the base it was checked against (KEVLAYA_MODEL__BASE)")
    rank: int | None
    target_modules: list[str] | str | None
    calibrated: bool
    loaded_at: datetime


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "kevlaya"
    kevlaya: ModelVersion | None = Field(
        default=None, description="for an adapter, its version; null for `auto` (its stages' are laya's and kev's) "
        "and for an adapter no worker has loaded yet")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def _card(name: str, version: AdapterVersion | None) -> ModelCard:
    if version is None:
        return ModelCard(id=name)
    described = ModelVersion(adapter_version=version.sha256, base=version.base, rank=version.rank,
                             target_modules=version.target_modules, calibrated=version.calibrated,
                             loaded_at=version.loaded_at)
    return ModelCard(id=name, created=int(version.first_loaded_at.timestamp()), kevlaya=described)


@router.get("", response_model=ModelList, responses=error_responses(422, *AUTH_ERRORS))
def list_models(_key: CurrentKey, session: SessionDep) -> ModelList:
    versions, unloaded = last_loaded(session), unloaded_roles(session)
    if "laya" in unloaded:
        unloaded.add("auto")
    names = [*ADAPTERS, "auto", *sorted(new_roles(session))]
    return ModelList(data=[_card(name, versions.get(name)) for name in names if name not in unloaded])
