# rlkit on a CUDA machine: vLLM rollouts + FSDP2 learner, one process per visible GPU.
#   docker build -t rlkit .
#   docker run --gpus all -e WANDB_API_KEY rlkit +recipe=grpo_gsm8k trainer.steps=100
FROM pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/cache/huggingface \
    RLKIT_CACHE=/cache/rlkit

RUN apt-get update && apt-get install -y --no-install-recommends git && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/rlkit
COPY . .
# Editable install: configs/ and recipes/ are read from the source tree next to the package.
RUN pip install -e ".[vllm]"

# Runs (checkpoints, metrics.jsonl, W&B offline runs) go under /runs; mount it to keep them.
WORKDIR /runs
ENTRYPOINT ["python", "-m", "rlkit.train"]
