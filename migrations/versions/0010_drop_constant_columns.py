"""drop the columns that only held constants: batches.mixed, batches.switch_ms, batches.oom_splits, jobs.switch_ms

Revision ID: 0010
Revises: 0009

A claim group serves one adapter and its rows never switch (docs/architecture.md §14), and an out-of-memory gives
rows back to the queue (`kevlaya_oom_give_backs`) instead of splitting a batch: every version since has written
0, 0.0 and false. Downgrade adds the columns back, filled with those constants.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0010'
down_revision: str | None = '0009'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BEFORE = ['started_at', 'worker', 'adapters', 'size', 'switch_ms', 'prefill_ms', 'decode_ms', 'tokens', 'oom_splits',
          'peak_vram_bytes']
DROPPED = [('batches', 'mixed'), ('batches', 'switch_ms'), ('batches', 'oom_splits'), ('jobs', 'switch_ms')]
AFTER = ['started_at', 'worker', 'adapters', 'size', 'prefill_ms', 'decode_ms', 'tokens', 'peak_vram_bytes']


def upgrade() -> None:
    op.drop_index('ix_batches_stats', 'batches')
    # Plain DROP COLUMN on both databases (SQLite ≥ 3.35): batch mode would copy `jobs` into a new table, and
    # dropping the old one would cascade-delete every cascade stage through parent_job_id.
    for table, column in DROPPED:
        op.execute(f'ALTER TABLE {table} DROP COLUMN {column}')
    op.create_index('ix_batches_stats', 'batches', AFTER)


def downgrade() -> None:
    op.drop_index('ix_batches_stats', 'batches')
    with op.batch_alter_table('batches') as batch:
        batch.add_column(sa.Column('mixed', sa.Boolean(), nullable=False, server_default=sa.false()))
        batch.add_column(sa.Column('switch_ms', sa.Float(), nullable=True))
        batch.add_column(sa.Column('oom_splits', sa.Integer(), nullable=True))
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('switch_ms', sa.Float(), nullable=True))
    op.execute("UPDATE batches SET switch_ms = 0, oom_splits = 0 WHERE finished_at IS NOT NULL")
    op.execute("UPDATE jobs SET switch_ms = 0 WHERE finished_at IS NOT NULL AND started_at IS NOT NULL")
    op.create_index('ix_batches_stats', 'batches', BEFORE)
