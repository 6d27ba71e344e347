"""jobs, batches and api keys

Revision ID: 0001
Revises: 
Create Date: 2026-11-29 08:48:19.667920
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import shared.models

revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('api_keys',
    sa.Column('id', sa.Uuid(), nullable=False),
    sa.Column('name', sa.String(length=100), nullable=False),
    sa.Column('key_hash', sa.String(length=64), nullable=False),
    sa.Column('is_admin', sa.Boolean(), nullable=False),
    sa.Column('rate_limit_per_minute', sa.Integer(), nullable=True),
    sa.Column('created_at', shared.models.UTCDateTime(timezone=True), nullable=False),
    sa.Column('revoked_at', shared.models.UTCDateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('key_hash')
    )
    op.create_table('batches',
    sa.Column('id', sa.Uuid(), nullable=False),
    sa.Column('adapters', sa.String(length=32), nullable=False),
    sa.Column('size', sa.Integer(), nullable=False),
    sa.Column('mixed', sa.Boolean(), nullable=False),
    sa.Column('switch_ms', sa.Float(), nullable=True),
    sa.Column('prefill_ms', sa.Float(), nullable=True),
    sa.Column('decode_ms', sa.Float(), nullable=True),
    sa.Column('tokens', sa.Integer(), nullable=True),
    sa.Column('peak_vram_bytes', sa.BigInteger(), nullable=True),
    sa.Column('worker', sa.String(length=200), nullable=False),
    sa.Column('started_at', shared.models.UTCDateTime(timezone=True), nullable=False),
    sa.Column('finished_at', shared.models.UTCDateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_table('jobs',
    sa.Column('id', sa.Uuid(), nullable=False),
    sa.Column('adapter', sa.String(length=8), nullable=False),
    sa.Column('requested_adapter', sa.String(length=8), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('input', sa.JSON(), nullable=False),
    sa.Column('params', sa.JSON(), nullable=False),
    sa.Column('metadata', sa.JSON(), nullable=True),
    sa.Column('result_text', sa.Text(), nullable=True),
    sa.Column('decision', sa.JSON(), nullable=True),
    sa.Column('error_code', sa.String(length=32), nullable=True),
    sa.Column('error_message', sa.Text(), nullable=True),
    sa.Column('idempotency_key', sa.String(length=200), nullable=True),
    sa.Column('api_key_id', sa.Uuid(), nullable=True),
    sa.Column('parent_job_id', sa.Uuid(), nullable=True),
    sa.Column('batch_id', sa.Uuid(), nullable=True),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('lease_owner', sa.String(length=200), nullable=True),
    sa.Column('lease_expires_at', shared.models.UTCDateTime(timezone=True), nullable=True),
    sa.Column('created_at', shared.models.UTCDateTime(timezone=True), nullable=False),
    sa.Column('started_at', shared.models.UTCDateTime(timezone=True), nullable=True),
    sa.Column('finished_at', shared.models.UTCDateTime(timezone=True), nullable=True),
    sa.Column('queue_ms', sa.Float(), nullable=True),
    sa.Column('switch_ms', sa.Float(), nullable=True),
    sa.Column('prefill_ms', sa.Float(), nullable=True),
    sa.Column('decode_ms', sa.Float(), nullable=True),
    sa.Column('total_ms', sa.Float(), nullable=True),
    sa.Column('prompt_tokens', sa.Integer(), nullable=True),
    sa.Column('completion_tokens', sa.Integer(), nullable=True),
    sa.ForeignKeyConstraint(['api_key_id'], ['api_keys.id'], ),
    sa.ForeignKeyConstraint(['batch_id'], ['batches.id'], ),
    sa.ForeignKeyConstraint(['parent_job_id'], ['jobs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('api_key_id', 'idempotency_key', name='uq_jobs_api_key_idempotency')
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_jobs_api_key_id'), ['api_key_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_jobs_batch_id'), ['batch_id'], unique=False)
        batch_op.create_index('ix_jobs_created_id', ['created_at', 'id'], unique=False)
        batch_op.create_index(batch_op.f('ix_jobs_parent_job_id'), ['parent_job_id'], unique=False)
        batch_op.create_index('ix_jobs_status_adapter_created', ['status', 'adapter', 'created_at'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index('ix_jobs_status_adapter_created')
        batch_op.drop_index(batch_op.f('ix_jobs_parent_job_id'))
        batch_op.drop_index('ix_jobs_created_id')
        batch_op.drop_index(batch_op.f('ix_jobs_batch_id'))
        batch_op.drop_index(batch_op.f('ix_jobs_api_key_id'))

    op.drop_table('jobs')
    op.drop_table('batches')
    op.drop_table('api_keys')
