"""`GET /v1/models`: the model names chat completions accept, in OpenAI's list format."""

from __future__ import annotations

from typing import Literal, get_args

from fastapi import APIRouter, Depends
from pydantic import BaseModel

from api.http.deps import reject_unknown_query_parameters
from api.http.errors import AUTH_ERRORS, error_responses
from api.keys.auth import CurrentKey
from shared.schemas import RequestedAdapter

router = APIRouter(prefix="/v1/models", tags=["chat"], dependencies=[Depends(reject_unknown_query_parameters)])


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "kevlaya"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


@router.get("", response_model=ModelList, responses=error_responses(422, *AUTH_ERRORS))
def list_models(_key: CurrentKey) -> ModelList:
    return ModelList(data=[ModelCard(id=name) for name in get_args(RequestedAdapter)])
