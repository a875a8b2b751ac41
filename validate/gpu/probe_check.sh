#!/usr/bin/env bash
# One device call: the probe's rows against the worker's for the jobs of a matrix (probe_rows.py, one
# launch per job, then `validate run` with one process per job), then the probe's cost
# (probe_demo.py) for the variants given, everything under $OUT, stopping new work at SECONDS.
#   usage: bash validate/gpu/probe_check.sh SECONDS MATRIX|- [probe_demo.py ARGS...]
#   PROBE_RESUME=DIR: start from an earlier call's probe-rows/ and worker.csv (jobs with a row are skipped)
set -u
budget=$1; matrix=$2; shift 2
[ -n "${PROBE_RESUME:-}" ] && cp -r "$PROBE_RESUME"/. $OUT/
source validate/gpu/setup.sh || exit 1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; lscpu | grep -E "^Model name|^CPU\(s\)"; python3 -c 'import torch, deepspeed, transformers, peft; print("torch", torch.__version__, "deepspeed", deepspeed.__version__, "transformers", transformers.__version__, "peft", peft.__version__)'; } > $OUT/env.txt 2>&1
python3 -c 'from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load()' > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; exit 1; }
deadline=$(( $(date +%s) + budget ))
left() { echo $(( deadline - $(date +%s) )); }
if [ "$matrix" != - ]; then
  mkdir -p $OUT/probe-rows
  n=$(python3 -c "from validate.jobs import load_matrix; print(len(load_matrix('$matrix')))")
  for i in $(seq 0 $((n - 1))); do
    [ $(left) -gt 30 ] || break
    key=$(python3 -c "from validate.jobs import load_matrix; print(load_matrix('$matrix')[$i]['key'])")
    [ -s $OUT/probe-rows/$key.csv ] && continue
    timeout $(left) python3 -m deepspeed.launcher.runner --num_gpus 1 validate/gpu/probe_rows.py $matrix $i \
      $OUT/probe-rows > $OUT/probe-rows/job$i.log 2>&1
    echo "probe job $i: rc $?, $(( budget - $(left) )) s"
  done
  [ $(left) -gt 30 ] && VALIDATE_FEW_STEPS=1 VALIDATE_ONE_JOB=1 timeout $(left) python3 -m validate run --backend cuda \
    --nproc 1 --matrix $matrix --timeout 300 --out $OUT/worker.csv > $OUT/worker.log 2>&1
  echo "worker: $(( budget - $(left) )) s"
  python3 validate/gpu/probe_vs_worker.py $OUT/probe-rows $OUT/worker.csv | tee $OUT/compare.txt
fi
if [ $# -gt 0 ] && [ $(left) -gt 30 ]; then
  timeout $(left) python3 -m deepspeed.launcher.runner --num_gpus 1 validate/gpu/probe_demo.py --out $OUT/overhead.json \
    "$@" > $OUT/overhead.log 2>&1
  tail -8 $OUT/overhead.log
fi
echo "done: $(( budget - $(left) )) s"
