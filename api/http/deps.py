"""The dependencies every router uses, as typed aliases so routes read like sentences: a database session, the
settings, and unknown query parameters refused."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from api.http.errors import ApiError
from shared.db import new_session
from shared.settings import Settings, get_settings


def get_session() -> Iterator[Session]:
    with new_session() as session:
        yield session


async def current_settings() -> Settings:
    return get_settings()


SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, Depends(current_settings)]

# Dependencies that do no I/O are `async def`: FastAPI runs a plain `def` dependency in its thread pool, and
# each such hop costs more than the dependency itself (a submit made eight of them).


async def reject_unknown_query_parameters(request: Request) -> None:
    """Query parameters a route does not take are refused, like unknown body fields (a typo such as
    `?stauts=failed` would otherwise silently list everything)."""
    if not request.query_params:
        return
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
