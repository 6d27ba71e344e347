"""adapter switches in /v1/stats come from each batch's switch_ms: the stats index carries it

Revision ID: 0004
Revises: 0003
"""
from collections.abc import Sequence

from alembic import op

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BEFORE = ['started_at', 'worker', 'adapters', 'size', 'prefill_ms', 'decode_ms', 'tokens', 'oom_splits',
          'peak_vram_bytes']
AFTER = ['started_at', 'worker', 'adapters', 'size', 'switch_ms', 'prefill_ms', 'decode_ms', 'tokens', 'oom_splits',
         'peak_vram_bytes']


def upgrade() -> None:
    op.drop_index('ix_batches_stats', 'batches')
    op.create_index('ix_batches_stats', 'batches', AFTER)


def downgrade() -> None:
    op.drop_index('ix_batches_stats', 'batches')
    op.create_index('ix_batches_stats', 'batches', BEFORE)
