# syntax=docker/dockerfile:1
# One image for the gateway, controller, prewarm initContainer and the simulator engine;
# the agent's image (`--target agent`) adds what compiling and loading its BPF programs
# needs. Both run as a non-root user by default (the agent's DaemonSet asks for root plus
# three capabilities explicitly).
#
#   docker build -t unbroken:0.1.0 .
#   docker build --target agent -t unbroken-agent:0.1.0 .

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# -- build: a virtualenv with unbroken and its dependencies, no compilers left behind ------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN /opt/venv/bin/pip install . && /opt/venv/bin/python -m unbroken --help >/dev/null

# -- base: runtime only --------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS base
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    UNBROKEN_CACHE_DIR=/tmp/unbroken-cache \
    UNBROKEN_STATE_DIR=/tmp/unbroken-state
RUN groupadd --gid 10001 unbroken \
 && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin unbroken
USER 10001:10001
ENTRYPOINT ["unbroken"]
CMD ["--help"]

# -- agent: + clang, bpftool and libbpf (CO-RE programs are built against the node's BTF
#    at start, cached in UNBROKEN_CACHE_DIR) ---------------------------------------------
FROM base AS agent
USER root
RUN apt-get update \
 && apt-get install -y --no-install-recommends clang llvm libbpf-dev libbpf1 bpftool \
 && rm -rf /var/lib/apt/lists/*
USER 10001:10001

# -- the default target ----------------------------------------------------------------------
FROM base AS unbroken
