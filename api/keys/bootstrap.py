"""`KEVLAYA_API__KEY` at the API's start: refused when weak, and the bootstrap rows of earlier values revoked.

The same revocation happens when a new value is first used (shared/keys.py `ensure_bootstrap_key`), so a database
that did not answer at the start, or another API process started with the new value, gives the same result."""

from __future__ import annotations

from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from shared.db import write_scope
from shared.keys import bootstrap_row, is_revoked, retire_old_bootstrap_keys, weak_key_problem
from shared.settings import Settings


def start_problem(settings: Settings) -> str | None:
    """Why the API must not start with this key, or None."""
    return weak_key_problem(settings.api.key.get_secret_value()) if settings.api.key else None


def retire_replaced_keys(settings: Settings) -> list[str]:
    """Revoke the bootstrap rows of values other than the current one (all of them when the setting is unset), and
    say what was done. Best effort: with the database away the first use of the value does it."""
    plain = settings.api.key.get_secret_value() if settings.api.key else None
    for attempt in range(2):
        try:
            with write_scope() as session:
                current, retired = bootstrap_row(session, plain) if plain else (None, 0)
                retired += retire_old_bootstrap_keys(session, current)
                revoked = current is not None and is_revoked(current)
            break
        except IntegrityError:  # another API process made the value's row at this moment: found the second time
            if attempt:
                raise
        except SQLAlchemyError as exc:
            return [f"bootstrap keys of earlier KEVLAYA_API__KEY values not checked ({type(exc).__name__}); they are "
                    "revoked at the new value's first use"]
    notes = [f"KEVLAYA_API__KEY {'changed' if plain else 'unset'}: {retired} earlier bootstrap key(s) "
             "revoked"] * bool(retired)
    if revoked:
        notes.append("KEVLAYA_API__KEY is a revoked key (a value used before, or revoked with `kevlaya keys revoke`): "
                     "it is refused; set a new value")
    return notes
