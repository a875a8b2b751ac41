#!/usr/bin/env bash
# One device call: what the probe costs, every run in a process of its own. For each repeat, each
# variant runs without and with the probe (alternating which goes first), as probe_demo.py --arm; the
# runs are pooled by probe_demo.py --combine into $OUT/overhead.json. New runs stop at SECONDS.
#   usage: bash validate/gpu/probe_overhead.sh SECONDS REPEATS VARIANTS [probe_demo.py ARGS...]
#   PROBE_RESUME=DIR: keep an earlier call's runs (DIR/runs/*.json); runs already there are skipped
set -u
budget=$1; repeats=$2; variants=$3; shift 3
deadline=$(( $(date +%s) + budget ))
left() { echo $(( deadline - $(date +%s) )); }
mkdir -p $OUT/runs
[ -n "${PROBE_RESUME:-}" ] && cp "$PROBE_RESUME"/runs/*.json $OUT/runs/ 2>/dev/null
source validate/gpu/setup.sh || exit 1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; lscpu | grep -E "^Model name|^CPU\(s\)"; python3 -c 'import torch, deepspeed, transformers, peft; print("torch", torch.__version__, "deepspeed", deepspeed.__version__, "transformers", transformers.__version__, "peft", peft.__version__)'; } > $OUT/env.txt 2>&1
python3 -c 'from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load()' > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; exit 1; }
echo "set up: $(( budget - $(left) )) s"
for r in $(seq 0 $((repeats - 1))); do
  for v in ${variants//,/ }; do
    arms="without with"; [ $((r % 2)) = 1 ] && arms="with without"
    for arm in $arms; do
      f=$OUT/runs/$v-$arm-$r.json
      [ -s $f ] && continue
      [ $(left) -gt 45 ] || break 3
      RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29517 timeout $(left) \
        python3 validate/gpu/probe_demo.py --variants $v --arm $arm --out $f "$@" > $OUT/runs/$v-$arm-$r.log 2>&1
      echo "$v $arm $r: rc $?, $(( budget - $(left) )) s"
    done
  done
done
python3 validate/gpu/probe_demo.py --combine $OUT/runs/*.json --out $OUT/overhead.json
