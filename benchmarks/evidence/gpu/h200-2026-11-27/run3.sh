#!/bin/bash
# rlkit's GPU check, third call (session 15): trainer.compile off (A) and on (B) in one call, same shape.
export PYTHONUNBUFFERED=1
S=/tmp/site; L=$OUT/all3.log
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $S .gpu/wheels/*.whl >> $L 2>&1 || echo "pip failed" >> $L
export PYTHONPATH=$PWD:$S
part() { local name=$1 t=$2; shift 2; local t0=$(date +%s); echo "=== $name (limit ${t}s): $*" >> $L; timeout $t "$@" > $OUT/$name.txt 2>> $L; echo "=== $name rc=$? in $(( $(date +%s) - t0 ))s" >> $L; }
B="python3 scripts/bench_learner.py --dtype bfloat16 --fixed-length --prompt-len 256 --response-len 1024 --max-tokens 16384 --config qwen2.5-0.5b --samples 64 --updates 3 --json"
part A_eager 80 $B
part B_compile 200 $B --compile
