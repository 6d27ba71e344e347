"""adapter assignments: what each role should serve, as an admin asked at run time (load, unload, reload)

Revision ID: 0013
Revises: 0012

One row per role that was loaded or unloaded at run time (docs/architecture.md §10); a role without one serves its
configured adapter (KEVLAYA_<ROLE>__PATH). Workers follow the rows at a safe point and read them at start.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from shared.models import UTCDateTime

revision: str = '0013'
down_revision: str | None = '0012'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'adapter_assignments',
        sa.Column('role', sa.String(length=64), nullable=False),
        sa.Column('path', sa.String(length=4096), nullable=True),
        sa.Column('sha256', sa.String(length=64), nullable=True),
        sa.Column('unloaded', sa.Boolean(), nullable=False),
        sa.Column('generation', sa.Integer(), nullable=False),
        sa.Column('requested_at', UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint('role'),
    )


def downgrade() -> None:
    op.drop_table('adapter_assignments')
