"""indexes for /v1/stats: jobs and batches of a time window without reading whole rows

Revision ID: 0003
Revises: 0002
"""
from collections.abc import Sequence

from alembic import op

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Every column the statistics read, after the window's column: a range scan of this index answers them
# without touching the table (whose rows hold prompts and answers).
JOB_STATS_COLUMNS = ['created_at', 'adapter', 'status', 'error_code', 'requested_adapter', 'parent_job_id',
                     'queue_ms', 'ttft_ms', 'decode_ms', 'total_ms', 'completion_tokens', 'id']
BATCH_STATS_COLUMNS = ['started_at', 'worker', 'adapters', 'size', 'prefill_ms', 'decode_ms', 'tokens',
                       'oom_splits', 'peak_vram_bytes']


def upgrade() -> None:
    op.create_index('ix_jobs_stats', 'jobs', JOB_STATS_COLUMNS)
    # Escalation: does this `auto` job have a Kev child?
    op.create_index('ix_jobs_parent_adapter', 'jobs', ['parent_job_id', 'adapter'])
    op.create_index('ix_batches_stats', 'batches', BATCH_STATS_COLUMNS)


def downgrade() -> None:
    op.drop_index('ix_batches_stats', 'batches')
    op.drop_index('ix_jobs_parent_adapter', 'jobs')
    op.drop_index('ix_jobs_stats', 'jobs')
