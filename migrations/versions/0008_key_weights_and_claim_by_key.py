"""fair share per key: api_keys.share_weight, and the claim index with the key before the age

Revision ID: 0008
Revises: 0007

A claim picks, per (adapter, priority), each key's oldest queued jobs (docs/architecture.md §3): the index
(status, adapter, priority, api_key_id, created_at) answers both the per-key counts and each key's oldest jobs, and
replaces (status, adapter, priority, created_at), whose prefix it keeps for the queue snapshot.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0008'
down_revision: str | None = '0007'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('api_keys') as batch:
        batch.add_column(sa.Column('share_weight', sa.Float(), nullable=False, server_default='1'))
    with op.batch_alter_table('jobs') as batch:
        batch.create_index('ix_jobs_claim_by_key', ['status', 'adapter', 'priority', 'api_key_id', 'created_at'])
        batch.drop_index('ix_jobs_status_adapter_priority_created')


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.create_index('ix_jobs_status_adapter_priority_created', ['status', 'adapter', 'priority', 'created_at'])
        batch.drop_index('ix_jobs_claim_by_key')
    with op.batch_alter_table('api_keys') as batch:
        batch.drop_column('share_weight')
