# rlkit on a CUDA machine: vLLM rollouts + FSDP2 learner, one process per visible GPU.
#   docker build -t rlkit .
#   docker run --gpus all -e WANDB_API_KEY rlkit +recipe=grpo_gsm8k trainer.steps=100
# Base: vllm==0.32.0 pins torch==2.13.0 (with torchvision==0.28.0, torchaudio==2.11.0), and PyPI's torch 2.13.0
# is built for CUDA 13.0 (its metadata requires cuda-toolkit==13.0.3, nvidia-cudnn-cu13 9.x), so the image's
# torch is the one vLLM's wheel was built against and pip keeps it. Not built here: the machine this was
# written on has no Docker daemon and no access to Docker Hub, so the tag itself is unverified.
FROM pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/cache/huggingface \
    RLKIT_CACHE=/cache/rlkit

RUN apt-get update && apt-get install -y --no-install-recommends git && rm -rf /var/lib/apt/lists/*

# Not editable: the wheel carries configs/ and recipes/ inside the package (rlkit/configs, rlkit/recipes),
# so the source tree is not needed once installed.
COPY . /tmp/rlkit
RUN pip install "/tmp/rlkit[vllm]" && rm -rf /tmp/rlkit

# Runs (checkpoints, metrics.jsonl, W&B offline runs) go under /runs; mount it to keep them.
WORKDIR /runs
ENTRYPOINT ["python", "-m", "rlkit.train"]
