# spot-trainer: one image for the training job (`job train`) and the uploader sidecar (`uploader watch`).
# Build: docker build -t spot-trainer .
# The base carries CUDA, cuDNN and a CUDA build of torch; pip keeps that torch (the project asks for torch>=2.6,
# where weights_only=True loading is safe: CVE-2025-32434).
ARG BASE_IMAGE=pytorch/pytorch:2.7.0-cuda12.8-cudnn9-runtime

FROM ${BASE_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY state ./state
COPY uploader ./uploader
COPY job ./job
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${BASE_IMAGE}
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    HOME=/home/trainer \
    JOB_SAVE_FOLDER=/checkpoints
COPY --from=build /wheels /wheels
# Only the project and its runtime dependencies; no compiler or build tools are added to this stage.
RUN python -m pip install --no-cache-dir /wheels/*.whl \
    && rm -rf /wheels \
    && useradd --create-home --uid 10001 --user-group trainer \
    && mkdir -p /checkpoints \
    && chown 10001:10001 /checkpoints
USER 10001:10001
WORKDIR /home/trainer
# Exec form: `job` is PID 1 and receives SIGTERM itself (it installs its own handlers).
ENTRYPOINT ["job"]
CMD ["train"]
