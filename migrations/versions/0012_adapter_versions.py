"""adapter versions: the adapter_versions table, and the version that answered each job (jobs.adapter_version)

Revision ID: 0012
Revises: 0011

An adapter version is the SHA-256 of its config and weights (docs/architecture.md §10). Jobs finished before keep a
null version: which weights answered them was never recorded. Plain ADD COLUMN on both databases: batch mode would
copy `jobs` into a new table (see 0010).
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from shared.models import UTCDateTime

revision: str = '0012'
down_revision: str | None = '0011'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'adapter_versions',
        sa.Column('name', sa.String(length=64), nullable=False),
        sa.Column('sha256', sa.String(length=64), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=True),
        sa.Column('target_modules', sa.JSON(), nullable=True),
        sa.Column('base', sa.String(length=1000), nullable=False),
        sa.Column('calibrated', sa.Boolean(), nullable=False),
        sa.Column('first_loaded_at', UTCDateTime(), nullable=False),
        sa.Column('loaded_at', UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint('name', 'sha256'),
    )
    op.add_column('jobs', sa.Column('adapter_version', sa.String(length=64), nullable=True))


def downgrade() -> None:
    op.drop_column('jobs', 'adapter_version')
    op.drop_table('adapter_versions')
