#!/usr/bin/env bash
# One device call: install DeepSpeed, build FusedAdam once, smoke-test, then run matrices, writing
# rows to $OUT as each job finishes.
#   usage: bash validate/gpu/sweep.sh SECONDS "NPROC:INCLUDE:MATRIX" ...
#   e.g.   bash validate/gpu/sweep.sh 480 1:localhost:0:validate/matrices/h200-n1-gpt.json 1:localhost:1:... \
#            then 2:localhost:0,1:validate/matrices/h200-n2.json
# Runs that share no GPU go in parallel; each stops at SECONDS (rows so far are kept, resumable).
# With VALIDATE_SNAPSHOT_DIR set, rank 0 dumps its allocator history for one step of each job there.
# The device returns at most 8 files from $OUT: pack logs before the command ends.
set -u
budget=$1; shift
source validate/gpu/setup.sh || exit 1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; lscpu | grep -E "^Model name|^CPU\(s\)"; python3 -c 'import torch, deepspeed, transformers; print("torch", torch.__version__, "deepspeed", deepspeed.__version__, "transformers", transformers.__version__, "gpus", torch.cuda.device_count())'; } | tee $OUT/env.txt
t0=$(date +%s)
python3 -c 'from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load()' > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; exit 1; }
echo "FusedAdam built in $(( $(date +%s) - t0 )) s"
if grep -lq '"offload_optimizer": "cpu"' "${@##*:}" 2>/dev/null; then   # offload jobs: DeepSpeedCPUAdam, built once here too
  t0=$(date +%s)
  python3 -c 'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()' >> $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; exit 1; }
  echo "CPUAdam built in $(( $(date +%s) - t0 )) s"
fi
mkdir -p data
for spec in "$@"; do   # resume: rows committed under the matrix's name are skipped
  f=data/$(basename "${spec##*:}" .json).csv; [ -e "$f" ] && cp "$f" $OUT/ && chmod u+w $OUT/$(basename "$f")
done
# Specs before a literal "then" run side by side; the next group starts when they have all ended.
# A token like "300s" caps its group's time (the overall SECONDS still holds).
# Timing rows want one job per host at a time: put such matrices in groups of their own.
deadline=$(( $(date +%s) + budget ))
run_group() {   # usage: run_group LIMIT_S SPEC...
  local pids=() spec nproc rest include matrix name left limit=$1; shift
  left=$(( deadline - $(date +%s) )); [ $left -gt 30 ] || { echo "no time left for: $*"; return; }
  [ $limit -gt 0 ] && [ $limit -lt $left ] && left=$limit
  for spec in "$@"; do
    nproc=${spec%%:*}; rest=${spec#*:}; include=${rest%:*}; matrix=${rest##*:}
    name=$(basename "$matrix" .json)
    timeout $left python3 -m validate run --backend cuda --nproc $nproc --include $include --matrix $matrix \
      --timeout 240 --out $OUT/$name.csv > $OUT/$name.log 2>&1 &
    pids+=($!)
  done
  # Fail fast: if the first job of a run is not ok, something systematic is wrong; stop and say why.
  while kill -0 "${pids[@]}" 2>/dev/null; do
    sleep 10
    bad=$(python3 - "$OUT" <<'PY'
import csv, glob, sys
for path in glob.glob(sys.argv[1] + "/h200-*.csv"):
    rows = list(csv.DictReader(open(path)))
    if rows and all(r["outcome"] == "error" for r in rows[:2]) and len(rows) >= 1:
        print(path, rows[0]["error"][:400])
PY
)
    if [ -n "$bad" ]; then echo "first job failed: $bad"; kill "${pids[@]}"; pkill -f validate.worker; exit 1; fi
  done
  for p in "${pids[@]}"; do wait $p; done
  pkill -f validate.worker; sleep 2   # a launch the time limit cut off must not run into the next group
}
group=(); limit=0
for spec in "$@"; do
  case $spec in
    then) run_group $limit "${group[@]}"; group=(); limit=0 ;;
    [0-9]*s) limit=${spec%s} ;;   # "300s": this group stops after 300 s (its rows so far are kept)
    *) group+=("$spec") ;;
  esac
done
[ ${#group[@]} -gt 0 ] && run_group $limit "${group[@]}"
for spec in "$@"; do [[ $spec = then || $spec =~ ^[0-9]+s$ ]] && continue; matrix=${spec##*:}; name=$(basename "$matrix" .json); echo "== $name"; grep -E '^\[|done' $OUT/$name.log | cut -c1-220; done
