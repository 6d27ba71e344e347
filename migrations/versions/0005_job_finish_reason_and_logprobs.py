"""why each job's answer ended, and its tokens' log-probabilities when asked: jobs.finish_reason, jobs.logprobs

Revision ID: 0005
Revises: 0004
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0005'
down_revision: str | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('finish_reason', sa.String(length=16), nullable=True))
        batch.add_column(sa.Column('logprobs', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('logprobs')
        batch.drop_column('finish_reason')
