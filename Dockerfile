# pipeplan service image: the API (`pipeplan serve`) and the workers (`pipeplan worker`) run from it.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# Dependencies first (cached layer), then the code.
COPY pyproject.toml README.md ./
COPY pipeplan ./pipeplan
COPY planner ./planner
COPY service ./service
COPY worker ./worker
COPY client ./client
COPY migrations ./migrations
COPY alembic.ini ./
# Every folder installs under the one name `pipeplan` (pyproject.toml's package-dir).
RUN pip install ".[server]"

RUN useradd --create-home --uid 10001 pipeplan && mkdir -p /data && chown pipeplan /data
USER pipeplan
ENV PIPEPLAN_DATA_DIR=/data \
    PIPEPLAN_HOST=0.0.0.0 \
    PIPEPLAN_PORT=8000

EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=6 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=3)"]
CMD ["pipeplan", "serve", "--host", "0.0.0.0", "--port", "8000"]
