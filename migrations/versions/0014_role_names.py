"""role names up to 32 characters: roles loaded at run time under new names take jobs

Revision ID: 0014
Revises: 0013

A role loaded under a new name (`POST /v1/load_lora_adapter`, docs/architecture.md §10) is a job's `adapter`,
`requested_adapter` and `answered_by`, which held only `kev`, `laya` and `auto`.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0014'
down_revision: str | None = '0013'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ('adapter', 'requested_adapter', 'answered_by')


def _widen_to(length: int, was: int) -> None:
    with op.batch_alter_table('jobs') as batch_op:
        for column in COLUMNS:
            batch_op.alter_column(column, type_=sa.String(length=length), existing_type=sa.String(length=was))


def upgrade() -> None:
    _widen_to(32, was=8)


def downgrade() -> None:
    _widen_to(8, was=32)
