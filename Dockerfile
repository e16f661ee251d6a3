# One image for every splitspec service; compose.yaml and deploy/kubernetes/ pick the command.
#
#   docker build -t splitspec .                              # CPU torch (the default), models mounted
#   docker build --target bundled -t splitspec:cpu .         # ... with the bundled models in /models
#   docker build --build-arg TORCH_FLAVOR=cuda --build-arg EXTRAS=cuda,otel --target bundled -t splitspec:cuda .
#
# TORCH_FLAVOR picks the torch build: `cpu` (PyTorch's CPU wheel index: a few hundred MB, no CUDA
# libraries) or `cuda` (PyPI's Linux wheel, which bundles the CUDA runtime: several GB). Each
# flavor is its own stage (torch-cpu, torch-cuda), so `--target torch-cuda` builds just that layer.
ARG TORCH_FLAVOR=cpu
ARG TORCH_VERSION=2.13.0

FROM python:3.11-slim AS python
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app

# torch first, in its own layer: it is by far the largest and changes least often.
FROM python AS torch-cpu
ARG TORCH_VERSION
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "${TORCH_CPU_INDEX}" "torch==${TORCH_VERSION}" \
 && python -c "import torch, sys; sys.exit(torch.version.cuda is not None)"

FROM python AS torch-cuda
ARG TORCH_VERSION
RUN pip install "torch==${TORCH_VERSION}" \
 && python -c "import torch, sys; sys.exit(torch.version.cuda is None)"

FROM torch-${TORCH_FLAVOR} AS app
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY splitspec ./splitspec
COPY target_service ./target_service
COPY draft_service ./draft_service
COPY gateway ./gateway
COPY splitspec_tools ./splitspec_tools
# otel: OpenTelemetry traces (--otlp-traces-endpoint), a few pure-Python packages
ARG EXTRAS="otel"
RUN pip install ".${EXTRAS:+[$EXTRAS]}" && splitspec --help > /dev/null
RUN useradd --create-home --uid 1000 splitspec && mkdir /models && chown splitspec /models
USER splitspec
EXPOSE 50050 50051 50052 8000 9100
CMD ["splitspec", "--help"]

# The bundled target and draft baked in at the paths compose mounts them on (/models/target,
# /models/draft): what deploy/kubernetes/ runs unless an overlay mounts other models there.
FROM app AS bundled
COPY --chown=splitspec models/splitspec-code-target /models/target
COPY --chown=splitspec models/splitspec-code-draft /models/draft

# The default target (the last stage): code and torch only; compose mounts ./models read-only.
FROM app AS plain
