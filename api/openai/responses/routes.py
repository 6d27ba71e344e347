"""`/v1/responses`: OpenAI's Responses API on the durable job (docs/architecture.md §17).

A response is a job: created through the same intake as every job (limits, quotas, the job writer), run by the
same workers, read back from its row. Without `background` the request waits for its job as chat does (the same
timeout, then 504 while the job goes on); with it, it answers at once. A key sees only its own responses, and never
one created with `store: false` (deleted once it was answered)."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.http.deps import SessionDep, SettingsDep, reject_unknown_query_parameters
from api.http.errors import AUTH_ERRORS, ApiError, ErrorResponse, error_responses
from api.jobs.deletion import delete_jobs
from api.jobs.intake import Intake, IntakeDep
from api.jobs.lookup import read_visible
from api.jobs.presenters import jobs_out
from api.jobs.waiting import wait_finished
from api.keys.auth import CurrentKey, SubmitterKey
from api.keys.caps import HeldStream, long_polls, streams
from api.openai.responses.schemas import (
    RESPONSES_FIELDS,
    ResponseDeleted,
    ResponseJob,
    ResponseObject,
    ResponsesRequest,
    StoredResponse,
    conversation,
    input_item_list,
    job_id_of,
    response_id,
    response_object,
    status_of,
)
from api.openai.responses.stream import response_stream
from shared import lifecycle
from shared.db import new_session, one_writer
from shared.models import ApiKey, Job, JobStatus
from shared.schemas import JobOut, JobParams
from shared.settings import Settings

router = APIRouter(prefix="/v1/responses", tags=["responses"],
                   dependencies=[Depends(reject_unknown_query_parameters)])

_STREAM = {"content": {"text/event-stream": {}}, "description": "The response; with `stream`, Server-Sent Events of "
           "the Responses event types, each with its `sequence_number`"}


def timeout_s(settings: Settings) -> float:
    """How long a response is waited for, or streamed: chat's timeout."""
    return settings.limits.chat_timeout_s


# -- reading a response --------------------------------------------------------------------------------------------


def own_response(session: Session, key: ApiKey, public_id: str, field: str = "") -> tuple[Job, StoredResponse]:
    """The key's stored response of that id, or 404 naming it (`field` first, where the id came in one)."""
    job_id = job_id_of(public_id)
    row = None if job_id is None else session.scalar(select(Job).where(Job.id == job_id, Job.api_key_id == key.id))
    stored = StoredResponse.of(row) if row is not None else None
    if stored is None or not stored.store:
        raise ApiError(404, "not_found", f"{field + ': ' if field else ''}response {public_id} not found")
    return row, stored


def read_response(key: ApiKey, public_id: str) -> tuple[JobOut, StoredResponse]:
    with new_session() as session:
        row, stored = own_response(session, key, public_id)
        return jobs_out(session, [row])[0], stored


def continued(key: ApiKey, public_id: str) -> tuple[uuid.UUID, list[dict[str, Any]]]:
    """The previous response's id and the conversation a response continuing it starts with."""
    with new_session() as session:
        job_id = job_id_of(public_id)
        row = None if job_id is None else session.scalar(select(Job).where(Job.id == job_id,
                                                                           Job.api_key_id == key.id))
        stored = StoredResponse.of(row) if row is not None else None
        if stored is None:
            raise ApiError(404, "not_found", f"previous_response_id: response {public_id} not found")
        if not stored.store:
            raise ApiError(400, "invalid_request", f"previous_response_id: response {public_id} was created with "
                           "store: false; it is not stored and cannot be continued")
        job = jobs_out(session, [row])[0]
    status = status_of(job)
    if status not in ("completed", "incomplete"):
        raise ApiError(409, "conflict", f"previous_response_id: response {public_id} is {status}; only a completed "
                       "or incomplete response can be continued")
    return job.id, conversation(job, stored)


def forget(job_id: uuid.UUID) -> None:
    """Delete a `store: false` response once it was answered (with its `auto` stages)."""
    with new_session() as session, one_writer(session):
        delete_jobs(session, Job.id == job_id, Job.status.in_(JobStatus.FINISHED))
        session.commit()


async def forget_later(job_id: uuid.UUID) -> None:
    await run_in_threadpool(forget, job_id)


# -- creating one --------------------------------------------------------------------------------------------------


def check(intake: Intake, job: ResponseJob, request: ResponsesRequest) -> None:
    """The intake's limits, named as this request names its fields; a prompt over the context because of the
    tools' definitions (in the system prompt) is refused naming the largest tool."""
    try:
        intake.check(job, names=RESPONSES_FIELDS)
    except ApiError as refused:
        if refused.status_code != 422 or not request.tools or not refused.message.startswith("input: the prompt"):
            raise
        bare = job.model_copy(update={"params": JobParams(max_new_tokens=job.params.max_new_tokens, output="text")})
        try:
            intake.check(bare, names=RESPONSES_FIELDS)
        except ApiError:
            raise refused from None  # too long without the tools as well
        sizes = [len(tool.model_dump_json(exclude_none=True)) for tool in request.tools]
        largest = max(range(len(sizes)), key=sizes.__getitem__)
        raise ApiError(422, "invalid_request", f"tools: the tools' definitions, in the system prompt, make it too "
                       f"long: {refused.message.removeprefix('input: ')}; the largest is tools.{largest} "
                       f"({request.tools[largest].name!r}, {sizes[largest]} characters)") from None


@router.post("", response_model=ResponseObject, responses={
    200: _STREAM, **error_responses(400, 404, 409, 413, *AUTH_ERRORS, 504),
    422: {"model": ErrorResponse, "description": "Invalid request; the message names the field"},
})
async def create_response(request: ResponsesRequest, key: SubmitterKey, intake: IntakeDep
                          ) -> ResponseObject | StreamingResponse:
    previous, earlier = None, []
    if request.previous_response_id is not None:
        previous, earlier = await run_in_threadpool(continued, key, request.previous_response_id)
    job_request = request.to_job(earlier, previous)
    check(intake, job_request, request)
    settings, wait_s = intake.settings, timeout_s(intake.settings)
    stored = StoredResponse(job_request.response_request, previous, job_request.response_store)
    # The key's place is taken before the job is stored: a request over its cap stores nothing.
    if request.stream:
        give_back = streams.take(key.id, settings.connections.streams_per_key)
        try:
            [accepted] = await intake.store(key, [job_request])
            job = await run_in_threadpool(read_visible, key, accepted.id)
        except BaseException:
            give_back()
            raise
        return HeldStream(response_stream(key, job, stored, wait_s, settings.streams.heartbeat_s,
                                          on_end=None if stored.store else forget_later), give_back)
    if request.background:
        [accepted] = await intake.store(key, [job_request])
        return response_object(await run_in_threadpool(read_visible, key, accepted.id), stored)
    with long_polls.hold(key.id, settings.connections.long_polls_per_key):
        [accepted] = await intake.store(key, [job_request])
        finished = await wait_finished(key, accepted.id, wait_s)
    rid = response_id(finished.id)
    if finished.status not in JobStatus.FINISHED:
        later = (f"retrieve it with GET /v1/responses/{rid}" if stored.store
                 else "it is not stored (store: false) and cannot be retrieved")
        raise ApiError(504, "timeout", f"response {rid} did not finish within {wait_s:g} s; it goes on: {later}")
    answer = response_object(finished, stored)
    if not stored.store:
        await forget_later(finished.id)
    return answer


# -- retrieve, stream again, delete, cancel, input items ----------------------------------------------------------


def refuse_include(include: list[str] | None) -> None:
    if include:
        raise ApiError(422, "invalid_request", f"include: {include[0]!r} is not supported (no include is)")


IncludeQuery = Annotated[list[str] | None, Query(description="none is supported")]
IncludeBrackets = Annotated[list[str] | None, Query(alias="include[]", include_in_schema=False)]


@router.get("/{response_id}", response_model=ResponseObject,
            responses={200: _STREAM, **error_responses(404, 422, *AUTH_ERRORS)})
async def retrieve_response(
        response_id: str, key: CurrentKey, settings: SettingsDep,
        stream: Annotated[bool, Query(description="its events from the start, as a stream: a stream that broke "
                                      "off resumes (with `starting_after`)")] = False,
        starting_after: Annotated[int | None, Query(ge=-1, description="with stream: only the events numbered "
                                                    "after this")] = None,
        include: IncludeQuery = None, include_brackets: IncludeBrackets = None,
        include_obfuscation: Annotated[bool | None, Query(description="taken; no obfuscation is added")] = None,
) -> ResponseObject | StreamingResponse:
    refuse_include(include or include_brackets)
    if starting_after is not None and not stream:
        raise ApiError(422, "invalid_request", "starting_after: only with stream=true")
    job, stored = await run_in_threadpool(read_response, key, response_id)
    if not stream:
        return response_object(job, stored)
    give_back = streams.take(key.id, settings.connections.streams_per_key)
    return HeldStream(response_stream(key, job, stored, timeout_s(settings), settings.streams.heartbeat_s,
                                      starting_after), give_back)


@router.delete("/{response_id}", response_model=ResponseDeleted,
               responses=error_responses(404, 409, 422, *AUTH_ERRORS))
def delete_response(response_id: str, key: CurrentKey, session: SessionDep) -> ResponseDeleted:
    """A finished response is deleted (its job, with its `auto` stages); a queued one is cancelled and deleted; a
    running one: 409, delete it once it has finished."""
    row, _stored = own_response(session, key, response_id)
    if row.file_batch_id is not None:
        raise ApiError(409, "conflict", f"response {response_id} is a line of a batch; it goes with the batch "
                       "(DELETE /v1/batches/{id})")
    with one_writer(session):
        lifecycle.cancel(session, row.id)  # a queued one; any other is left as it is
        deleted = delete_jobs(session, Job.id == row.id, Job.status.in_(JobStatus.FINISHED))
        session.commit()
    if not deleted:
        raise ApiError(409, "conflict", f"response {response_id} is in_progress; delete it once it has finished")
    return ResponseDeleted(id=response_id)


@router.post("/{response_id}/cancel", response_model=ResponseObject,
             responses=error_responses(400, 404, 409, 422, *AUTH_ERRORS))
def cancel_response(response_id: str, key: CurrentKey, session: SessionDep) -> ResponseObject:
    """A queued background response is cancelled, as `POST /v1/jobs/{id}/cancel` cancels its job; one that has
    started or finished is left as it is (409); a cancelled one is answered as it is."""
    row, stored = own_response(session, key, response_id)
    if not stored.request.get("background"):
        raise ApiError(400, "invalid_request", f"response {response_id} was not created with background: true; "
                       "only a background response can be cancelled")
    with one_writer(session):
        cancelled = lifecycle.cancel(session, row.id)
        session.commit()
    session.refresh(row)
    job = jobs_out(session, [row])[0]
    if not cancelled and row.status != JobStatus.CANCELLED:
        raise ApiError(409, "conflict", f"response {response_id} is {status_of(job)}; only a queued response can be "
                       "cancelled")
    return response_object(job, stored)


class InputItemList(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


@router.get("/{response_id}/input_items", response_model=InputItemList,
            responses=error_responses(404, 422, *AUTH_ERRORS))
def list_input_items(response_id: str, key: CurrentKey, session: SessionDep,
                     limit: Annotated[int, Query(ge=1, le=100)] = 20,
                     order: Annotated[Literal["asc", "desc"], Query()] = "desc",
                     after: Annotated[str | None, Query(min_length=1, description="an item id: the page starts after "
                                                        "it")] = None,
                     include: IncludeQuery = None, include_brackets: IncludeBrackets = None) -> InputItemList:
    """The response's own input items (a previous response's are listed under that one)."""
    refuse_include(include or include_brackets)
    row, stored = own_response(session, key, response_id)
    items = input_item_list(row.id, stored)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise ApiError(404, "not_found", f"after: no input item {after} in response {response_id}")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return InputItemList(data=page, first_id=page[0]["id"] if page else None, last_id=page[-1]["id"] if page else None,
                         has_more=len(items) > limit)
