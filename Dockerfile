# spot-trainer: two images from one Dockerfile.
#   trainer (the default: the last stage) runs the training job, `job train`:
#       docker build -t spot-trainer:0.1.0 .
#   uploader runs the storage sidecar, `uploader watch`, on a slim Python with boto3, click, tenacity,
#   blake3 and crc32c only: torch is not installed there, so nothing in it can import torch.
#       docker build --target uploader -t spot-trainer-uploader:0.1.0 .
# The trainer's base carries CUDA, cuDNN and a CUDA build of torch; pip keeps that torch (the project asks
# for torch>=2.6, where weights_only=True loading is safe: CVE-2025-32434).
#
# Sizes, estimated (no image was built for this; unpacked on disk / compressed as pulled):
#   trainer  ~6 GB / ~3.2 GB, nearly all of it the pytorch base. torch 2.7.0's own wheel set from PyPI
#            (torch, triton and the nvidia-* CUDA 12 / cuDNN 9 wheels it depends on; the CUDA 12.6 build,
#            the base's 12.8 one is similar) is 3.0 GB zipped and 5.4 GB unpacked, read from the wheels'
#            zip directories (`pip install --dry-run --report` for the list); the base adds Ubuntu,
#            conda's Python, torchvision and torchaudio. The project's layer adds ~110 MB (tensorboard
#            and what it pulls in ~80 MB: its data server 20 MB, grpcio 19 MB, pillow 22 MB, itself 12 MB;
#            botocore 22 MB, torchmetrics 4 MB, the project 0.4 MB), ~170 MB if the base's Python lacks
#            numpy (57 MB). --no-tensorboard does not shrink it; the import is skipped, not the install.
#   uploader ~165 MB / ~60 MB: python:3.11-slim is ~130 MB / ~45 MB (Debian bookworm-slim plus CPython,
#            as Docker Hub and `docker images` list it); boto3, botocore, s3transfer, urllib3, jmespath,
#            python-dateutil, six, click and tenacity are 17.7 MB of wheels (`pip download boto3==1.44.8
#            click==8.5.1 tenacity==9.2.1`) and 33 MB installed with their .pyc files (`pip install
#            --target`, then `du -sb`); blake3 (format 3's digests) adds a 0.39 MB wheel, 1.0 MB
#            installed; crc32c (the upload's CRC32C over plain HTTP) a 0.08 MB wheel, 0.2 MB installed;
#            the project's wheel 0.4 MB.
ARG BASE_IMAGE=pytorch/pytorch:2.7.0-cuda12.8-cudnn9-runtime
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

# The project's wheel is pure Python: built on the small image, so `--target uploader` never pulls the
# multi-GB torch base.
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY state ./state
COPY uploader ./uploader
COPY job ./job
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE} AS uploader
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/uploader
COPY --from=build /wheels /wheels
# What the uploader imports, pinned (within pyproject.toml's ranges), then the project with --no-deps:
# torch, torchmetrics and numpy, which only `job` needs, are never installed. /checkpoints is owned by
# uid 10001 as in the trainer, so a fresh compose volume is writable by the job whichever image mounts
# it first.
RUN python -m pip install --no-cache-dir boto3==1.44.8 click==8.5.1 tenacity==9.2.1 blake3==1.0.11 crc32c==2.9.post0 \
    && python -m pip install --no-cache-dir --no-deps /wheels/*.whl \
    && rm -rf /wheels \
    && useradd --create-home --uid 10001 --user-group uploader \
    && mkdir -p /checkpoints \
    && chown 10001:10001 /checkpoints
USER 10001:10001
WORKDIR /home/uploader
# Exec form: `uploader` is PID 1 and receives SIGTERM itself. Its commands need their arguments
# (`watch LOCAL REMOTE`, `ls REMOTE`, ...), which the manifests and compose.yaml pass; alone it prints help.
ENTRYPOINT ["uploader"]
CMD ["--help"]

# Last, so that a plain `docker build .` builds the trainer.
FROM ${BASE_IMAGE} AS trainer
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
