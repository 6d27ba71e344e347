"""quotas and retention: key_usage (each key's stored bytes and its own limits), jobs.stored_bytes, and an index on
jobs.finished_at for the retention sweep

Revision ID: 0009
Revises: 0008

Each job row records the bytes it charges its key (its request, plus its result once finished); key_usage holds
each key's total of them and of its files (docs/architecture.md §16). Rows stored before this migration are
charged here by the length of their stored text.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0009'
down_revision: str | None = '0008'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TEXT_COLUMNS = ('input', 'params', 'metadata', 'idempotency_key', 'result_text', 'decision', 'logprobs',
                 'error_message')


def _bytes_of(dialect: str, column: str) -> str:
    if dialect == 'postgresql':
        return f"octet_length(coalesce(CAST({column} AS text), ''))"
    return f"coalesce(length(CAST({column} AS BLOB)), 0)"


def upgrade() -> None:
    op.create_table(
        'key_usage',
        sa.Column('api_key_id', sa.Uuid(), sa.ForeignKey('api_keys.id', ondelete='CASCADE'), primary_key=True),
        sa.Column('stored_bytes', sa.BigInteger(), nullable=False, server_default='0'),
        sa.Column('max_queued_jobs', sa.Integer(), nullable=True),
        sa.Column('max_stored_bytes', sa.BigInteger(), nullable=True),
    )
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('stored_bytes', sa.BigInteger(), nullable=False, server_default='0'))
        batch.create_index('ix_jobs_finished_at', ['finished_at'])
    dialect = op.get_bind().dialect.name
    op.execute("UPDATE jobs SET stored_bytes = " + " + ".join(_bytes_of(dialect, c) for c in _TEXT_COLUMNS))
    op.execute(
        "INSERT INTO key_usage (api_key_id, stored_bytes) SELECT api_keys.id, "
        "(SELECT coalesce(sum(jobs.stored_bytes), 0) FROM jobs WHERE jobs.api_key_id = api_keys.id) + "
        "(SELECT coalesce(sum(files.bytes), 0) FROM files WHERE files.api_key_id = api_keys.id) FROM api_keys")


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_index('ix_jobs_finished_at')
        batch.drop_column('stored_bytes')
    op.drop_table('key_usage')
