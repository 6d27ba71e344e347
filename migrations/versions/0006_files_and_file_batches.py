"""the Batch API: files, file_batches and their rejected lines; jobs.priority, file_batch_id, batch_line, custom_id

Revision ID: 0006
Revises: 0005
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from shared.models import UTCDateTime

revision: str = '0006'
down_revision: str | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'files',
        sa.Column('id', sa.Uuid(), nullable=False),
        sa.Column('api_key_id', sa.Uuid(), sa.ForeignKey('api_keys.id'), nullable=True),
        sa.Column('purpose', sa.String(length=32), nullable=False),
        sa.Column('filename', sa.String(length=255), nullable=False),
        sa.Column('bytes', sa.BigInteger(), nullable=False),
        sa.Column('lines', sa.Integer(), nullable=False),
        sa.Column('created_at', UTCDateTime(), nullable=False),
        sa.Column('expires_at', UTCDateTime(), nullable=True),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_files_key_created', 'files', ['api_key_id', 'created_at', 'id'])
    op.create_table(
        'file_batches',
        sa.Column('id', sa.Uuid(), nullable=False),
        sa.Column('api_key_id', sa.Uuid(), sa.ForeignKey('api_keys.id'), nullable=True),
        sa.Column('status', sa.String(length=16), nullable=False),
        sa.Column('endpoint', sa.String(length=64), nullable=False),
        sa.Column('completion_window', sa.String(length=16), nullable=False),
        sa.Column('input_file_id', sa.Uuid(), nullable=False),
        sa.Column('output_file_id', sa.Uuid(), nullable=True),
        sa.Column('error_file_id', sa.Uuid(), nullable=True),
        sa.Column('output_expires_after_s', sa.Integer(), nullable=True),
        sa.Column('metadata', sa.JSON(), nullable=True),
        sa.Column('errors', sa.JSON(), nullable=True),
        sa.Column('total', sa.Integer(), nullable=False),
        sa.Column('lease_owner', sa.String(length=200), nullable=True),
        sa.Column('lease_expires_at', UTCDateTime(), nullable=True),
        sa.Column('created_at', UTCDateTime(), nullable=False),
        sa.Column('expires_at', UTCDateTime(), nullable=False),
        *(sa.Column(f'{state}_at', UTCDateTime(), nullable=True) for state in
          ('in_progress', 'finalizing', 'completed', 'failed', 'expired', 'cancelling', 'cancelled')),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_file_batches_key_created', 'file_batches', ['api_key_id', 'created_at', 'id'])
    op.create_index('ix_file_batches_status', 'file_batches', ['status'])
    op.create_table(
        'file_batch_rejects',
        sa.Column('file_batch_id', sa.Uuid(), sa.ForeignKey('file_batches.id', ondelete='CASCADE'), nullable=False),
        sa.Column('batch_line', sa.Integer(), nullable=False),
        sa.Column('custom_id', sa.String(length=512), nullable=False),
        sa.Column('status_code', sa.Integer(), nullable=False),
        sa.Column('error_code', sa.String(length=32), nullable=False),
        sa.Column('error_message', sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint('file_batch_id', 'batch_line'),
    )
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('priority', sa.Integer(), server_default='0', nullable=False))
        batch.add_column(sa.Column('file_batch_id', sa.Uuid(), nullable=True))
        batch.add_column(sa.Column('batch_line', sa.Integer(), nullable=True))
        batch.add_column(sa.Column('custom_id', sa.String(length=512), nullable=True))
        batch.create_foreign_key('fk_jobs_file_batch_id', 'file_batches', ['file_batch_id'], ['id'],
                                 ondelete='CASCADE')
        batch.create_unique_constraint('uq_jobs_file_batch_line', ['file_batch_id', 'batch_line'])
        batch.drop_index('ix_jobs_status_adapter_created')
        batch.create_index('ix_jobs_status_adapter_priority_created', ['status', 'adapter', 'priority', 'created_at'])
        batch.create_index('ix_jobs_file_batch_status', ['file_batch_id', 'status'])


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_index('ix_jobs_file_batch_status')
        batch.drop_index('ix_jobs_status_adapter_priority_created')
        batch.create_index('ix_jobs_status_adapter_created', ['status', 'adapter', 'created_at'])
        batch.drop_constraint('uq_jobs_file_batch_line', type_='unique')
        batch.drop_constraint('fk_jobs_file_batch_id', type_='foreignkey')
        batch.drop_column('custom_id')
        batch.drop_column('batch_line')
        batch.drop_column('file_batch_id')
        batch.drop_column('priority')
    op.drop_table('file_batch_rejects')
    op.drop_index('ix_file_batches_status', 'file_batches')
    op.drop_index('ix_file_batches_key_created', 'file_batches')
    op.drop_table('file_batches')
    op.drop_index('ix_files_key_created', 'files')
    op.drop_table('files')
