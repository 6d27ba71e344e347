"""vLLM's run-time adapter routes, with its names and bodies so its clients work (admin keys only;
docs/architecture.md §10): `POST /v1/load_lora_adapter` loads an adapter into a role, or reloads the role in place;
`POST /v1/unload_lora_adapter` stops the role taking jobs. Each checks everything first (shared/adapter_check.py)
and records nothing it refuses; what it accepts becomes the role's desired state (shared/adapter_assignments.py),
which workers follow at a safe point. As vLLM, success is 200 with a short plain-text message."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from api.http.deps import SettingsDep, reject_unknown_query_parameters
from api.http.errors import AUTH_ERRORS, ApiError, error_responses
from api.keys.auth import AdminKey
from shared.adapter_assignments import assign, unload
from shared.adapter_check import AdapterRefused, check_adapter, check_role
from shared.db import write_scope
from shared.queue import QueueUnavailable, publish_wakeup

log = logging.getLogger("kevlaya.api")
router = APIRouter(prefix="/v1", tags=["adapters"], dependencies=[Depends(reject_unknown_query_parameters)])
_TEXT = {200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "vLLM's short success message"}}


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(max_length=64, description="the role: `kev` or `laya` (their adapter is replaced), or a new "
                           "name, which becomes a role of its own (KEVLAYA_MODEL__SPARE_ROLES of them at once)")
    lora_path: str = Field(max_length=4096, description="the adapter's directory, under KEVLAYA_MODEL__ADAPTER_ROOT")
    load_inplace: bool | None = Field(default=None, description="vLLM's flag; a load under a loaded name is always "
                                      "a reload in place here")


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(max_length=64, description="the role: `kev`, `laya`, or one loaded under a new name")
    lora_int_id: int | None = Field(default=None, description="vLLM's id; ignored (the name says which)")


def _refused(refusal: AdapterRefused) -> ApiError:
    return ApiError(400, "invalid_adapter", str(refusal),
                    fields=[{"field": refusal.field, "message": refusal.message}])


def _wake(role: str) -> None:
    """An idle worker drains on a wake-up and follows the new state first; one that serves notices it anyway."""
    try:
        publish_wakeup(None, role)
    except QueueUnavailable:
        log.warning("no wake-up for the change of adapter %s (Redis is down): workers see it at their next sweep",
                    role)


@router.post("/load_lora_adapter", responses={**_TEXT, **error_responses(
    400, 403, 422, *AUTH_ERRORS)})
def load_lora_adapter(body: LoadLoRAAdapterRequest, _key: AdminKey, settings: SettingsDep) -> PlainTextResponse:
    """Load the adapter at `lora_path` as the role `lora_name`, replacing the role's adapter in place (a reload
    when it is the same name, as in vLLM). Jobs claimed before the switch finish on the old version; jobs claimed
    after it are answered by the new one, and record its version. Refused with 400 naming the field and why: a
    path outside the allowed directory, missing files, an unreadable config, another base, a rank over the
    maximum, target modules the worker does not hold, NaN or infinite weights, or a new role when every spare
    block is taken. A new name becomes a role of its own: it is listed in `/v1/models` and takes jobs, chat
    completions, responses and batch lines."""
    try:
        checked = check_adapter(body.lora_name, body.lora_path, settings)
    except AdapterRefused as refusal:
        raise _refused(refusal) from None
    try:
        with write_scope() as session:
            generation = assign(session, checked, settings.model.spare_roles)
    except AdapterRefused as refusal:
        raise _refused(refusal) from None
    log.info("adapter %s: %s (version %s) asked for, generation %d", checked.role, checked.path, checked.sha256,
             generation)
    _wake(checked.role)
    return PlainTextResponse(f"Success: LoRA adapter '{checked.role}' added successfully.")


@router.post("/unload_lora_adapter", responses={**_TEXT, **error_responses(
    400, 403, 404, 422, *AUTH_ERRORS)})
def unload_lora_adapter(body: UnloadLoRAAdapterRequest, _key: AdminKey) -> PlainTextResponse:
    """Stop the role `lora_name` taking jobs: new submits to it are refused (503 `adapter_unloaded`), its queued
    jobs wait until it is loaded again, its running rows finish, and `/v1/models` no longer lists it; a role under a
    new name frees its spare block. 404 when it is unloaded already or was never loaded, as vLLM answers for a
    name it does not hold."""
    try:
        role = check_role(body.lora_name)
    except AdapterRefused as refusal:
        raise _refused(refusal) from None
    with write_scope() as session:
        changed = unload(session, role)
    if not changed:
        raise ApiError(404, "not_found", f"lora_name: the LoRA adapter '{role}' is not loaded",
                       fields=[{"field": "lora_name", "message": "not loaded"}])
    log.info("adapter %s: unload asked for", role)
    _wake(role)
    return PlainTextResponse(f"Success: LoRA adapter '{role}' removed successfully.")
