"""How many connections one API process holds open, in all and per client address (RELIABILITY.md, Security).

Every accepted socket is a file descriptor; past the process's soft limit nothing is accepted any more, `/healthz`
included, and the database, Redis and file opens fail too. So the process keeps its connections under a cap set
below that limit. At a cap the new connection is not the one refused: the connection that has waited longest for a
request head is closed instead (an idle keep-alive, an idle or trickling socket), as nginx reuses idle connections,
so a crowd of idle sockets cannot keep a real client out. A new connection is refused only when every counted one
is in the middle of a request.
"""

from __future__ import annotations

import resource
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from shared.settings import Settings

# Descriptors left to the process itself: its database pool, Redis clients, files being read or written, the job
# writer's pipes, logs.
RESERVED_FDS = 256
MAX_BACKLOG = 2048  # uvicorn's default listen backlog


@dataclass(frozen=True)
class ConnectionCaps:
    total: int
    per_address: int
    backlog: int  # the listen backlog: also how many sockets one pass of the accept loop may take before any closes
    fd_limit: int
    clamped: bool  # KEVLAYA_CONNECTIONS__MAX asked for more than the descriptors allow


def connection_caps(settings: Settings, fd_limit: int | None = None) -> ConnectionCaps:
    if fd_limit is None:
        fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if fd_limit == resource.RLIM_INFINITY:
            fd_limit = 1 << 20
    backlog = min(MAX_BACKLOG, max(16, fd_limit // 8))
    room = max(16, fd_limit - backlog - RESERVED_FDS)
    asked = settings.connections.max
    total = min(asked or room, room)
    per_address = min(settings.connections.max_per_address or max(1, total // 2), total)
    return ConnectionCaps(total, per_address, backlog, fd_limit, clamped=asked is not None and asked > room)


class Closable(Protocol):
    def close_idle(self) -> None: ...


class OpenConnections:
    """The counted connections of one process (one event loop: no locking). A connection is `waiting` from its
    opening, and from the end of each response, until its next request head has arrived."""

    def __init__(self, total: int, per_address: int) -> None:
        self.total, self.per_address = total, per_address
        self._address: dict[Closable, str] = {}
        self._per_address: Counter[str] = Counter()
        self._waiting: dict[Closable, None] = {}  # oldest first (dicts keep insertion order)
        self._waiting_at: dict[str, dict[Closable, None]] = {}

    def __len__(self) -> int:
        return len(self._address)

    def admit(self, connection: Closable, address: str) -> bool:
        """Count a new connection, closing the longest-waiting one where a cap is reached; False (not counted) when
        no connection can make room."""
        if self._per_address[address] >= self.per_address and not self._close_oldest(self._waiting_at.get(address)):
            return False
        if len(self._address) >= self.total and not self._close_oldest(self._waiting):
            return False
        self._address[connection] = address
        self._per_address[address] += 1
        return True

    def waiting(self, connection: Closable) -> None:
        address = self._address.get(connection)
        if address is None:
            return
        self.busy(connection)  # moved to the end: the newest waiter
        self._waiting[connection] = None
        self._waiting_at.setdefault(address, {})[connection] = None

    def busy(self, connection: Closable) -> None:
        address = self._address.get(connection)
        if address is None:
            return
        self._waiting.pop(connection, None)
        at = self._waiting_at.get(address)
        if at is not None:
            at.pop(connection, None)
            if not at:
                del self._waiting_at[address]

    def leave(self, connection: Closable) -> None:
        if connection not in self._address:
            return
        self.busy(connection)
        address = self._address.pop(connection)
        self._per_address[address] -= 1
        if not self._per_address[address]:
            del self._per_address[address]

    def _close_oldest(self, candidates: dict[Closable, None] | None) -> bool:
        oldest = next(iter(candidates), None) if candidates else None
        if oldest is None:
            return False
        self.leave(oldest)
        oldest.close_idle()
        return True
