#!/bin/bash
# rlkit's first GPU check (session 15, 2026-11-27): every part in its own process with its own time limit.
export PYTHONUNBUFFERED=1
S=/tmp/site; L=$OUT/all.log
{ date -u; nvidia-smi; python3 --version; } >> $L 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $S .gpu/wheels/*.whl >> $L 2>&1 || echo "pip failed" >> $L
PYTHONPATH=$S python3 -c "import pyarrow,sys; print('image pyarrow', pyarrow.__version__); sys.exit(int(pyarrow.__version__.split('.')[0])<24)" >> $L 2>&1 || { tar xJf .gpu/pyarrow-*.tar.xz -C $S && echo "carried pyarrow 26 unpacked" >> $L; }
export PYTHONPATH=$PWD:$S
python3 -c "import torch, transformers, accelerate, peft, datasets, omegaconf, math_verify; print('versions', torch.__version__, torch.version.cuda, transformers.__version__, accelerate.__version__, peft.__version__, datasets.__version__)" >> $L 2>&1
part() { local name=$1 t=$2; shift 2; local t0=$(date +%s); echo "=== $name (limit ${t}s)" >> $L; timeout $t "$@" > $OUT/$name.json 2>> $L; echo "=== $name rc=$? in $(( $(date +%s) - t0 ))s" >> $L; }
part collectives 60 python3 scripts/gpu_check.py --bundle .gpu --parts collectives
part fsdp2 100 python3 scripts/gpu_check.py --bundle .gpu --parts fsdp2
part learner 80 python3 scripts/gpu_check.py --bundle .gpu --parts learner
part e2e 80 python3 scripts/gpu_check.py --bundle .gpu --parts e2e
part tests 60 python3 -m pytest -q -m gpu tests/misc/test_gpu_check.py tests/rollout/test_vllm_gpu.py -p no:cacheprovider
part big 70 python3 scripts/bench_learner.py --config .gpu/qwen3-0.6b --samples 64 --prompt-len 256 --response-len 1024 --updates 5 --dtype bfloat16 --gradient-checkpointing --fixed-length --json
date -u >> $L
