"""Whether a Redis URL may be used: one beyond this host needs a password (RELIABILITY.md, Security).

Whoever reaches a Redis without a password reads every running job's live output and can write into it (an `XADD`
to a job's stream reaches its client as model output), and can wake or drop the workers' messages."""

from __future__ import annotations

import ipaddress
from urllib.parse import parse_qs, urlsplit

from shared.logs import masked_url

LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def has_password(url: str) -> bool:
    parts = urlsplit(url)
    return bool(parts.password) or bool(parse_qs(parts.query).get("password"))


def redis_url_problem(url: str, allow_no_password: bool = False) -> str | None:
    """Why the API or a worker must not use the Redis at `url`, or None. A Unix socket is guarded by its file's
    permissions; a loopback address by the host (with `kevlaya run`'s generated password on top)."""
    parts = urlsplit(url)
    if parts.scheme == "unix" or has_password(url) or is_loopback(parts.hostname) or allow_no_password:
        return None
    return (f"KEVLAYA_REDIS__URL ({masked_url(url)}) has no password and its host {parts.hostname} is not a loopback "
            "address: anyone who reaches it reads and writes every job's live output. Set one "
            "(`redis://:password@host:6379/0`, Redis started with `requirepass`), or, on a network nobody else reaches, "
            "KEVLAYA_REDIS__ALLOW_NO_PASSWORD=true")


def with_password(url: str, password: str) -> str:
    """`url` with `password` as the default user's (`redis://:password@host:port/db`)."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f":{password}@{host}").geturl()
