"""which adapter's answer a job ended with: jobs.answered_by (an escalated `auto` job: kev)

Revision ID: 0007
Revises: 0006

Finished jobs stored before this revision get it from what they already hold: an `auto` job that has a Kev
stage was answered by kev, any other job that succeeded or failed by its own adapter; cancelled ones stay null.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0007'
down_revision: str | None = '0006'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('answered_by', sa.String(length=8), nullable=True))
    jobs = sa.table('jobs', sa.column('id', sa.Uuid()), sa.column('adapter', sa.String()),
                    sa.column('requested_adapter', sa.String()), sa.column('status', sa.String()),
                    sa.column('parent_job_id', sa.Uuid()), sa.column('answered_by', sa.String()))
    stage = jobs.alias('stage')
    finished = jobs.c.status.in_(['succeeded', 'failed'])
    escalated = sa.exists().where(stage.c.parent_job_id == jobs.c.id, stage.c.adapter == 'kev')
    op.execute(jobs.update().where(finished, jobs.c.requested_adapter == 'auto', jobs.c.parent_job_id.is_(None),
                                   escalated).values(answered_by='kev'))
    op.execute(jobs.update().where(finished, jobs.c.answered_by.is_(None)).values(answered_by=jobs.c.adapter))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('answered_by')
