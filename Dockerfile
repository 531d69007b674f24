# rlkit on a CUDA machine: vLLM rollouts + FSDP2 learner, one process per visible GPU.
#   docker build -t rlkit .
#   docker run --gpus all --ipc=host -e WANDB_API_KEY rlkit +recipe=grpo_gsm8k trainer.steps=100
# --ipc=host: NCCL moves data between the GPUs of one machine through /dev/shm, and Docker's default 64 MB
# /dev/shm makes the first collective of a multi-GPU run fail (or pass --shm-size=16g instead).
# Base: vllm==0.32.0 pins torch==2.13.0 (with torchvision==0.28.0, torchaudio==2.11.0), and PyPI's torch 2.13.0
# is built for CUDA 13.0 (its metadata requires cuda-toolkit==13.0.3, nvidia-cudnn-cu13 9.x), so the image's
# torch is the one vLLM's wheel was built against and pip keeps it. Not built here: the machine this was
# written on has no Docker daemon and no access to Docker Hub, so the tag itself is unverified.
# -devel, not -runtime: vLLM on CUDA launches Triton kernels every step (enforce_eager does not avoid them), and
# Triton compiles its CUDA driver stub with the system C compiler on first use; the -runtime image has none.
# The -devel image also brings nvcc, for the kernels vLLM's dependencies compile just in time.
FROM pytorch/pytorch:2.13.0-cuda13.0-cudnn9-devel

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/cache/huggingface \
    RLKIT_CACHE=/cache/rlkit

# build-essential: the C compiler Triton calls (stated, not left to what the base image happens to hold).
RUN apt-get update && apt-get install -y --no-install-recommends git build-essential && rm -rf /var/lib/apt/lists/*

# Not editable: the wheel carries configs/ and recipes/ inside the package (rlkit/configs, rlkit/recipes),
# so the source tree is not needed once installed.
COPY . /tmp/rlkit
RUN pip install "/tmp/rlkit[vllm]" && rm -rf /tmp/rlkit

# Runs (checkpoints, metrics.jsonl, W&B offline runs) go under /runs; mount it to keep them.
WORKDIR /runs
ENTRYPOINT ["python", "-m", "rlkit.train"]
