"""the Responses API's columns on jobs: response_request, previous_response_id, response_store

Revision ID: 0011
Revises: 0010

A response of `/v1/responses` is a job (docs/architecture.md §17): these hold what the Responses API needs beyond
the job itself, all null for every other job. Plain ADD COLUMN on both databases: batch mode would copy `jobs`
into a new table (see 0010).
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0011'
down_revision: str | None = '0010'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = [('response_request', sa.JSON()), ('previous_response_id', sa.Uuid()), ('response_store', sa.Boolean())]


def upgrade() -> None:
    for name, kind in COLUMNS:
        op.add_column('jobs', sa.Column(name, kind, nullable=True))


def downgrade() -> None:
    for name, _kind in reversed(COLUMNS):
        op.drop_column('jobs', name)
