#!/usr/bin/env bash
# One device call on one GPU: install DeepSpeed, build FusedAdam once, then run lanes side by side,
# each lane its matrices one after another, writing rows to $OUT as each job finishes. For jobs that
# measure memory only (peaks are per process, so lanes sharing the GPU do not disturb them as long as
# their peaks together fit it: a row whose job had to free cached blocks says so, measured_alloc_retries).
#   usage: bash validate/gpu/lanes.sh SECONDS LANE... [then LANE...]...
#   (lanes before a "then" run side by side; the next group starts when they have all ended: lanes of
#   emulated cards whose capacities together must stay within the GPU)
#   or:    bash validate/gpu/lanes.sh SECONDS --pack ROOM_GIB ITEM...  (validate/gpu/pack.py: each matrix
#   started as soon as the GPU has room for it; ITEM: NPROC[f]:MATRIX:GIB[:VAR=VALUE,...])
#   LANE:  items separated by ";", each NPROC[f[RANK]]:MATRIX[:VAR=VALUE,...]  (f: --fake-world, as rank RANK
#          where given (--fake-rank); the
#          variables are set for that item alone, e.g. VALIDATE_SNAPSHOT_DIR=$OUT/snap; a value cannot hold
#          "," or ";": export VALIDATE_STEPS=2,1,1 for the whole command instead)
#   e.g.   bash validate/gpu/lanes.sh 540 "64f:validate/matrices/a.json;256f:validate/matrices/b.json" "2f:..."
# Everything under $OUT is packed into $OUT/lanes.tar.gz at the end (the device returns 8 files).
set -u
budget=$1; shift
source validate/gpu/setup.sh || exit 1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; lscpu | grep -E "^Model name|^CPU\(s\)"; python3 -c 'import torch, deepspeed, transformers; print("torch", torch.__version__, "deepspeed", deepspeed.__version__, "transformers", transformers.__version__, "gpus", torch.cuda.device_count())'; } > $OUT/env.txt 2>&1
cat $OUT/env.txt
t0=$(date +%s)
python3 -c 'from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load()' > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; exit 1; }
echo "FusedAdam built in $(( $(date +%s) - t0 )) s"
if grep -lq '"offload_optimizer": "cpu"' $(printf '%s\n' "$@" | tr ';' '\n' | sed -E 's/^~?[0-9]+f?://; s/:.*//') 2>/dev/null; then
  python3 -c 'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()' >> $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; exit 1; }
fi
deadline=$(( $(date +%s) + budget ))
run_item() {   # NPROC[f[RANK]]:MATRIX[:VAR=VALUE,...]
  local item=$1 nproc matrix vars name fake="" rank left IFS=$' \t\n'
  nproc=${item%%:*}; rest=${item#*:}; matrix=${rest%%:*}; vars=""; [[ $rest == *:* ]] && vars=${rest#*:}
  [[ $nproc == *f* ]] && { rank=${nproc#*f}; fake="--fake-world --fake-rank ${rank:-0}"; nproc=${nproc%%f*}; }
  name=$(basename "$matrix" .json)
  left=$(( deadline - $(date +%s) )); [ $left -gt 20 ] || { echo "no time left for $name"; return; }
  env ${vars//,/ } timeout $left python3 -m validate run --backend cuda --nproc $nproc $fake --include localhost:0 \
    --matrix $matrix --timeout 400 --out $OUT/$name.csv > $OUT/$name.log 2>&1
  echo "$name: $(grep -c '^\[' $OUT/$name.log) rows, $(( $(date +%s) - deadline + budget )) s"
}
run_group() {   # lanes side by side; the next group starts when they have all ended
  local pids=() lane p
  for lane in "$@"; do
    ( IFS=';'; for item in $lane; do run_item "$item"; done ) &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait $p; done
  pkill -f validate.worker
}
if [ "$1" = --pack ]; then   # --pack ROOM_GIB ITEM...: each matrix started when the GPU has room (pack.py)
  python3 validate/gpu/pack.py $budget $2 $OUT "${@:3}"; pkill -f validate.worker
else
  group=()
  for lane in "$@"; do
    if [ "$lane" = then ]; then run_group "${group[@]}"; group=(); else group+=("$lane"); fi
  done
  [ ${#group[@]} -gt 0 ] && run_group "${group[@]}"
fi
for d in $OUT/*/; do   # allocator histories: compacted (the pickles stay behind)
  [ -d "$d" ] && ls $d/*.pickle >/dev/null 2>&1 && python3 -m validate snapshot --compact-to $OUT/histories $d/*.pickle && rm -r $d
done
for f in $OUT/*.log; do echo "== $f"; grep -E '^\[|done|Error' $f | cut -c1-250; done
(cd $OUT && tar czf lanes.tar.gz --exclude lanes.tar.gz * && find . -mindepth 1 -not -name lanes.tar.gz -delete)
