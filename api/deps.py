"""Dependencies as typed aliases, so routes read like sentences."""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Annotated

import redis
from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.errors import ApiError
from api.prompt_budget import PromptBudget
from api.wakeups import WakeupPublisher
from shared.db import new_session
from shared.keys import ensure_bootstrap_key, find_key
from shared.models import ApiKey
from shared.queue import redis_client
from shared.settings import Settings, get_settings


def get_session() -> Iterator[Session]:
    with new_session() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, Depends(get_settings)]


def reject_unknown_query_parameters(request: Request) -> None:
    """Query parameters a route does not take are refused, like unknown body fields (a typo such as
    `?stauts=failed` would otherwise silently list everything)."""
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    if dependant is None:
        return
    known: set[str] = set()
    pending = [dependant]
    while pending:  # the route's own parameters and those of its dependencies
        current = pending.pop()
        known |= {param.alias for param in current.query_params}
        pending.extend(current.dependencies)
    unknown = sorted(set(request.query_params) - known)
    if unknown:
        takes = f"it takes {', '.join(sorted(known))}" if known else "it takes none"
        raise ApiError(422, "invalid_request", f"{unknown[0] or '(empty name)'}: unknown query parameter; {takes}")


def get_prompt_budget(request: Request) -> PromptBudget | None:
    return getattr(request.app.state, "prompt_budget", None)


PromptBudgetDep = Annotated[PromptBudget | None, Depends(get_prompt_budget)]


def get_wakeups(request: Request) -> WakeupPublisher:
    return request.app.state.wakeups


WakeupsDep = Annotated[WakeupPublisher, Depends(get_wakeups)]

_bearer = HTTPBearer(auto_error=False)
log = logging.getLogger("kevlaya.api")


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, "unauthorized", message, headers={"WWW-Authenticate": "Bearer"})


def _revoked(row: ApiKey) -> bool:
    return row.revoked_at is not None and row.revoked_at <= datetime.now(timezone.utc)


def current_key(
    session: SessionDep,
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> ApiKey:
    if credentials is None or credentials.scheme.lower() != "bearer" or not credentials.credentials:
        raise _unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    plain = credentials.credentials
    bootstrap = settings.api_key.get_secret_value() if settings.api_key else None
    if bootstrap and hmac.compare_digest(plain.encode(), bootstrap.encode()):
        try:
            row = ensure_bootstrap_key(session, plain)
            session.commit()
        except IntegrityError:  # another request created it first
            session.rollback()
            row = find_key(session, plain)
        # Revocable like any key (`kevlaya keys revoke`); a new KEVLAYA_API_KEY value gets a fresh row.
        if _revoked(row):
            raise _unauthorized("API key revoked")
        return row
    row = find_key(session, plain)
    if row is None:
        raise _unauthorized("invalid API key")
    if _revoked(row):
        raise _unauthorized("API key revoked")
    if row.rate_limit_per_minute is not None:
        _enforce_rate_limit(row)
    return row


def _enforce_rate_limit(key: ApiKey) -> None:
    """A fixed one-minute window per key, counted in Redis so every API process shares it."""
    window = int(time.time() // 60)
    counter = f"kevlaya:rate:{key.id}:{window}"
    try:
        pipeline = redis_client().pipeline()
        pipeline.incr(counter)
        pipeline.expire(counter, 120)
        used = pipeline.execute()[0]
    except redis.RedisError:
        log.warning("rate limit of key %s not checked: Redis unavailable", key.id)
        return  # reads must keep working while Redis is down; submits refuse on their own
    if used > key.rate_limit_per_minute:
        retry_after = str(60 - int(time.time()) % 60)
        raise ApiError(429, "rate_limited", f"this key allows {key.rate_limit_per_minute} requests per minute",
                       headers={"Retry-After": retry_after})


CurrentKey = Annotated[ApiKey, Depends(current_key)]


def admin_key(key: CurrentKey) -> ApiKey:
    if not key.is_admin:
        raise ApiError(403, "forbidden", "this needs an admin key")
    return key


AdminKey = Annotated[ApiKey, Depends(admin_key)]
