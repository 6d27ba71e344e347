"""Who is asking: the API key of a request (`Authorization: Bearer`), checked against the database (or, for the submit
routes, a cache of keys seen lately), with failures throttled per client address; and the admin key."""

from __future__ import annotations

import hmac
import time
from typing import Annotated

from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.http.deps import SessionDep, SettingsDep
from api.http.errors import ApiError, unauthorized
from api.keys.throttle import AuthThrottle
from shared.db import new_session
from shared.keys import ensure_bootstrap_key, find_key, hash_key, is_revoked, weak_key_problem
from shared.models import ApiKey
from shared.settings import Settings, get_settings

_bearer = HTTPBearer(auto_error=False)
BearerDep = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _bearer_key(credentials: HTTPAuthorizationCredentials | None) -> str:
    if credentials is None or credentials.scheme.lower() != "bearer" or not credentials.credentials:
        raise unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    return credentials.credentials


def _stored_key(session: Session, settings: Settings, plain: str) -> ApiKey:
    """The key's row, valid and not revoked, or 401."""
    bootstrap = settings.api.key.get_secret_value() if settings.api.key else None
    if bootstrap and hmac.compare_digest(plain.encode(), bootstrap.encode()):
        if problem := weak_key_problem(bootstrap):  # `kevlaya api` refuses to start with it; an app built otherwise
            raise unauthorized(problem)
        try:
            # Revocable like any key (`kevlaya keys revoke`); a new value gets a fresh row and revokes the old ones.
            row = ensure_bootstrap_key(session, plain)
            session.commit()
        except IntegrityError:  # another request or API process created it first
            session.rollback()
            row = find_key(session, plain)
    else:
        row = find_key(session, plain)
        if row is None:
            raise unauthorized("invalid API key")
    if is_revoked(row):
        raise unauthorized("API key revoked")
    return row


def _client_address(request: Request) -> str:
    return request.client.host if request.client else ""


def _checked_key(request: Request, session: Session, settings: Settings, plain: str) -> ApiKey:
    """`_stored_key`, with a wrong or revoked key counted against the client's address (api/keys/throttle.py)."""
    try:
        return _stored_key(session, settings, plain)
    except ApiError as refused:
        if refused.status_code == 401:
            _auth_throttle(request).failed(_client_address(request), settings)
        raise


def _auth_throttle(request: Request) -> AuthThrottle:
    return request.app.state.auth_throttle


def current_key(request: Request, session: SessionDep, settings: SettingsDep, credentials: BearerDep) -> ApiKey:
    # Reads are not rate limited: a key's rate counts the jobs it submits (api/keys/rate.py).
    _auth_throttle(request).check(_client_address(request), settings)
    return _checked_key(request, session, settings, _bearer_key(credentials))


class KeyCache:
    """Keys seen in the last `ttl_s` seconds, by hash, for the submit routes only: their job writer checks
    each key again in the transaction that stores its jobs (api/jobs/writer.py), so a key revoked meanwhile
    still stores nothing. A submit then reads no key from the database on its way in."""

    def __init__(self, ttl_s: float = 10.0):
        self.ttl_s = ttl_s
        self._rows: dict[str, tuple[float, ApiKey]] = {}

    def get(self, key_hash: str) -> ApiKey | None:
        entry = self._rows.get(key_hash)
        return entry[1] if entry and entry[0] > time.monotonic() else None

    def put(self, key_hash: str, row: ApiKey) -> None:
        now = time.monotonic()
        if len(self._rows) > 10_000:  # expired entries of keys no longer used
            self._rows = {h: entry for h, entry in self._rows.items() if entry[0] > now}
        self._rows[key_hash] = (now + self.ttl_s, row)


async def submitter_key(request: Request, credentials: BearerDep) -> ApiKey:
    """The key, as `current_key` checks it; its rate limit is charged per job when the jobs are stored
    (api/jobs/intake.py, api/keys/rate.py)."""
    settings = get_settings()
    _auth_throttle(request).check(_client_address(request), settings)
    plain = _bearer_key(credentials)
    cache: KeyCache = request.app.state.key_cache
    key_hash = hash_key(plain)
    row = cache.get(key_hash)
    if row is None:
        def read() -> ApiKey:
            with new_session() as session:
                return _checked_key(request, session, settings, plain)

        row = await run_in_threadpool(read)
        cache.put(key_hash, row)
    elif is_revoked(row):  # revoked at a time set in advance
        raise unauthorized("API key revoked")
    return row


CurrentKey = Annotated[ApiKey, Depends(current_key)]
SubmitterKey = Annotated[ApiKey, Depends(submitter_key)]  # the same checks, for routes that store through JobWriter


def admin_key(key: CurrentKey) -> ApiKey:
    if not key.is_admin:
        raise ApiError(403, "forbidden", "this needs an admin key")
    return key


AdminKey = Annotated[ApiKey, Depends(admin_key)]
