#!/bin/bash
# rlkit's GPU check, second call (session 15): the learner at larger batches, and a profile.
export PYTHONUNBUFFERED=1
S=/tmp/site; L=$OUT/all2.log
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $S .gpu/wheels/*.whl >> $L 2>&1 || echo "pip failed" >> $L
export PYTHONPATH=$PWD:$S
part() { local name=$1 t=$2; shift 2; local t0=$(date +%s); echo "=== $name (limit ${t}s): $*" >> $L; timeout $t "$@" > $OUT/$name.txt 2>> $L; echo "=== $name rc=$? in $(( $(date +%s) - t0 ))s" >> $L; }
B="python3 scripts/bench_learner.py --dtype bfloat16 --fixed-length --prompt-len 256 --response-len 1024 --max-tokens 16384"
part q25_64x1280 100 $B --config qwen2.5-0.5b --samples 64 --updates 3 --json
part q3_32x1280 100 $B --config .gpu/qwen3-0.6b --samples 32 --updates 3 --json
part profile_16x768 90 python3 scripts/bench_learner.py --config qwen2.5-0.5b --dtype bfloat16 --samples 16 --prompt-len 256 --response-len 512 --updates 3 --profile 30
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv >> $L 2>&1
