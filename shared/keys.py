"""API keys: random tokens shown once; only their SHA-256 is stored (they are high-entropy, so no KDF needed).

A key set by hand (`KEVLAYA_API__KEY`) must be as hard to guess as a made one: see `weak_key_problem`. That key is
a row too, named `BOOTSTRAP_NAME`; a new value revokes the rows of the values before it (`retire_old_bootstrap_keys`).
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime, timezone

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from shared.models import ApiKey

KEY_PREFIX = "kl_"
BOOTSTRAP_NAME = "bootstrap"  # the row of KEVLAYA_API__KEY's value; `kevlaya keys create` refuses the name
MIN_KEY_CHARS = 32
MIN_DISTINCT_CHARS = 10
KEY_RULE = (f"at least {MIN_KEY_CHARS} characters, at least {MIN_DISTINCT_CHARS} of them different "
            "(make one with `kevlaya keys generate`)")


def weak_key_problem(key: str, setting: str = "KEVLAYA_API__KEY") -> str | None:
    """Why `key`, given by hand in `setting`, is too easy to guess, or None. A floor, not a measure: a made key
    (`generate_key`, 46 characters of 64 kinds) passes, and so does a hex string of 128 random bits; a word, a short
    string or one character repeated does not."""
    if len(key) < MIN_KEY_CHARS:
        return f"{setting} is too short ({len(key)} characters): an API key needs {KEY_RULE}"
    if len(set(key)) < MIN_DISTINCT_CHARS:
        return f"{setting} has only {len(set(key))} different characters: an API key needs {KEY_RULE}"
    return None


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def create_key(session: Session, name: str, *, admin: bool = False, rate_limit_per_minute: int | None = None,
               share_weight: float = 1.0) -> tuple[ApiKey, str]:
    """Store a new key; returns the row and the plain key (the only time it exists)."""
    plain = generate_key()
    row = ApiKey(name=name, key_hash=hash_key(plain), is_admin=admin, rate_limit_per_minute=rate_limit_per_minute,
                 share_weight=share_weight)
    session.add(row)
    session.flush()
    return row, plain


def is_revoked(row: ApiKey) -> bool:
    return is_revoked_at(row.revoked_at)


def is_revoked_at(revoked_at: datetime | None) -> bool:
    return revoked_at is not None and revoked_at <= datetime.now(timezone.utc)


def find_key(session: Session, plain: str) -> ApiKey | None:
    return session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(plain)))


def ensure_bootstrap_key(session: Session, plain: str) -> ApiKey:
    """The `KEVLAYA_API__KEY` admin key gets a row too, so its jobs have an owner like any other. A value seen for
    the first time revokes the rows of the values before it (the caller commits both together)."""
    return bootstrap_row(session, plain)[0]


def bootstrap_row(session: Session, plain: str) -> tuple[ApiKey, int]:
    """`ensure_bootstrap_key`, and how many rows of earlier values it revoked."""
    row = find_key(session, plain)
    if row is not None:
        return row, 0
    row = ApiKey(name=BOOTSTRAP_NAME, key_hash=hash_key(plain), is_admin=True, created_at=datetime.now(timezone.utc))
    session.add(row)
    session.flush()
    return row, retire_old_bootstrap_keys(session, row)


def retire_old_bootstrap_keys(session: Session, current: ApiKey | None) -> int:
    """Revoke the bootstrap rows made before `current` (every one when None: the setting is unset); returns how many.

    Only older rows: an API process still running with the previous value, or restarted with it, then revokes
    nothing of the newer value's, and its own value stays revoked, so the newest value wins in every process. A value
    used before and revoked is never valid again (a value rotated back to must be new)."""
    now = datetime.now(timezone.utc)
    older = [ApiKey.name == BOOTSTRAP_NAME, (ApiKey.revoked_at.is_(None)) | (ApiKey.revoked_at > now)]
    if current is not None:
        older += [ApiKey.id != current.id, ApiKey.created_at < current.created_at]
    return session.execute(update(ApiKey).where(*older).values(revoked_at=now)).rowcount
