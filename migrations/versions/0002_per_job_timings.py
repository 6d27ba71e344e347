"""per-job time to first token, out-of-memory splits per batch

Revision ID: 0002
Revises: 0001
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch_op:
        batch_op.add_column(sa.Column('ttft_ms', sa.Float(), nullable=True))
    with op.batch_alter_table('batches') as batch_op:
        batch_op.add_column(sa.Column('oom_splits', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('batches') as batch_op:
        batch_op.drop_column('oom_splits')
    with op.batch_alter_table('jobs') as batch_op:
        batch_op.drop_column('ttft_ms')
