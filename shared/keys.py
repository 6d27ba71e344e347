"""API keys: random tokens shown once; only their SHA-256 is stored (they are high-entropy, so no KDF needed)."""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime, timezone

from sqlalchemy import select
from sqlalchemy.orm import Session

from shared.models import ApiKey

KEY_PREFIX = "kl_"


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
    """The `KEVLAYA_API_KEY` admin key gets a row too, so its jobs have an owner like any other."""
    row = find_key(session, plain)
    if row is None:
        row = ApiKey(name="bootstrap", key_hash=hash_key(plain), is_admin=True)
        session.add(row)
        session.flush()
    return row
