#!/usr/bin/env bash
# One call on a lent GPU: bench/gpu.sh's PHASES under one total limit, everything packed into
# OUT/gpu.tgz (the device tool brings back at most 8 files), a summary of the results printed last.
#
#   bench/gpu-run.sh OUT SECONDS PHASE...     e.g. bench/gpu-run.sh "$OUT" 510 env attention train760 train124 packed
#                                             or bench/gpu-run.sh "$OUT" 540 env fp8 fp8loss (FP8_STEPS=300)
OUT=${1:?usage: bench/gpu-run.sh OUT SECONDS PHASE...}
LIMIT=${2:?usage: bench/gpu-run.sh OUT SECONDS PHASE...}
shift 2
WORK=/tmp/gpu-run
rm -rf "$WORK"
export GPU_DEADLINE=$(( $(date +%s) + LIMIT - 10 ))  # gpu.sh shortens or skips what would run past it
timeout "$LIMIT" "$(dirname "$0")/gpu.sh" "$WORK" "$@"
rm -rf "$WORK/runs" "$WORK"/profile*  # run directories and traces: large, and summarised in the logs
tar czf "$OUT/gpu.tgz" -C "$WORK" bench logs
cp "$WORK/logs/summary.txt" "$OUT/summary.txt"
echo "=== results"
for log in "$WORK"/logs/*.log; do
  grep -E "^(cudnn|pallas|splash|dot_product|xla|jax \(ours\)|jax without fp8|fp8 / without|  total |FAILED |[0-9]+ (passed|failed)|prompt/completion|DPO, |one client|[0-9]+ clients? |sample.py|first token)" "$log" | sed "s|^|$(basename "$log" .log): |" | cut -c1-300
done
for log in "$WORK"/logs/p760.log "$WORK"/logs/p124.log; do  # phase mfu's profiles by model part
  [ -f "$log" ] && { echo "=== $(basename "$log" .log)"; grep -A 26 "profile: device busy" "$log" | cut -c1-140; }
done
[ -f "$WORK/logs/fp8-loss.txt" ] && { echo "=== fp8 loss"; cat "$WORK/logs/fp8-loss.txt"; }
exit 0
