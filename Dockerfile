# One image for every splitspec service; compose.yaml picks the command per service.
#   docker build -t splitspec .
# CPU torch by default. For CUDA, build FROM a CUDA base and add the cuda extra:
#   docker build --build-arg EXTRAS=cuda ...
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app

# torch first, in its own layer: it is by far the largest and changes least often.
ARG TORCH_SPEC=torch==2.13.0
ARG PIP_TORCH_ARGS=""
RUN pip install ${PIP_TORCH_ARGS} "${TORCH_SPEC}"

COPY pyproject.toml README.md ./
COPY protos ./protos
COPY splitspec ./splitspec
COPY target_service ./target_service
COPY draft_service ./draft_service
COPY gateway ./gateway
ARG EXTRAS=""
RUN pip install ".${EXTRAS:+[$EXTRAS]}" && splitspec --help > /dev/null

# Models are mounted read-only at run time (compose.yaml), never baked in.
RUN useradd --create-home --uid 1000 splitspec && mkdir /models && chown splitspec /models
USER splitspec
EXPOSE 50050 50051 50052 8000 9100
CMD ["splitspec", "--help"]
