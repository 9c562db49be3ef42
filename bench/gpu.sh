#!/usr/bin/env bash
# The GPU measurements of bench/RESULTS.md, in one command per phase, for a machine with one NVIDIA GPU.
#
#   bench/gpu.sh OUT PHASE...      phases: env mfu fp8 fp8loss check exact attention train124 packed train760 muon dpo serve torch flags profile memory lora
#   (PYTHON=python3 by default: the interpreter that has jax[cuda], torch and transformers)
#
# Each phase's benchmarks are recorded by bench.py under OUT/bench (JSON files and a copy of
# RESULTS.md with the new rows on top); every command's output goes to OUT/logs. Every command has
# its own time limit, so one that hangs or fails leaves the rest of the plan running. `check` needs
# the default corpus prepared (python data.py) or prepares it first.
#
#   env        the GPU, the driver and the library versions
#   mfu        what is left of the MFU targets (760m: 50% at T = 2048, 124m: 38%): both steps profiled, their
#              device time summed by model part (bench.py train --profile: "profile by scope"), then 760m
#              with the loss in chunks against auto's whole logits, and under each XLA flag that could take
#              time out of the reductions and elementwise kernels (cuBLASLt epilogues, cuDNN LayerNorm,
#              the latency-hiding scheduler). About 6 minutes on an H100; under bench/gpu-run.sh a command that
#              would outlast its limit is shortened or skipped.
#   fp8        760m at T = 2048 (B = 8) with the blocks' projections in FP8 (model.fp8) beside the same step in
#              bfloat16 in one run (bench.py train --fp8: tokens/s of each, their ratio, each compiled step's
#              memory), and `train.py --plan` for each. About 3 minutes on an H100.
#   fp8loss    FP8_STEPS (default 300) steps of train.py for 760m on the default corpus (prepared first if need
#              be) in bfloat16 without and then with FP8, their losses side by side in logs/fp8-loss.txt. About
#              2-3 minutes a run on an H100 (compilation, the steps, the final checkpoint).
#   check      a few bfloat16 steps of `python train.py` with each attention implementation, run side
#              by side (the GPU is shared; nothing is timed); the losses must fall and match xla's
#   exact      ALiBi on the real kernels at a long context (bench.py attention, T = 32768: cudnn's error beside
#              pallas's), and test_attention.py's checks on this GPU: the compiled steps of a cudnn run (plain
#              rows: cuDNN's kernel; packed and FCM rows: pallas) hold no (T, T) array, ALiBi within each
#              dtype's rounding at every length. About 3 minutes on an H100.
#   attention  python bench.py attention: cudnn (ALiBi as head dimensions) and pallas at 760m's shape
#              (T = 2048 and 8192) and 124m's, and pallas on rows of 4 packed examples: error, memory, time
#   train124   python bench.py train for 124m (T = 1024, B = 16): auto's choice with the chunked loss
#              and the whole one, and pallas
#   packed     the 124m step on fine-tuning batches (4 examples packed a row; and with FCM), beside train124
#   train760   760m at T = 2048 (B = 8) and at T = 8192 (B = 1)
#   muon       training.optimizer=muon's step against AdamW's at 124m and 760m (bench.py train --optimizer)
#   dpo        a DPO step (reference precomputed, and in the step) against a prompt/completion step on the same
#              tokens, at 124m (bench.py dpo --model 124m)
#   serve      serve.py on a 124m run made here (one step of train.py on the default corpus, prepared first if
#              need be): tokens/s with 1 and 16 clients at once against one at a time (bench.py serve)
#   torch      PyTorch side by side with our step at 124m and 760m (slow: torch.compile)
#   flags      the step under XLA flags known to matter on Hopper, one set at a time
#   profile    the kernel's settings at 760m's training shape, and where the step's time goes
#              (bench.py train --profile: device time per operation) for 124m and 760m
#   memory     the memory plan against the GPU: 124m (B = 16) and 760m (B = 8, T = 2048) under each
#              remat policy, the loss over the whole logits and in chunks (their speed too), each
#              beside `train.py --plan` for the same config (logs/plan-*.log)
#   lora       LoRA steps (rank 8 on q and v, a bfloat16 base) of TinyLlama-1.1B, GPT-J-6B and LLaMA-7B's
#              shapes at 8 x 2048, remat none and full: peak memory and speed, each beside its plan
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bench/gpu.sh OUT PHASE...}
shift
mkdir -p "$OUT/logs" "$OUT/bench"
[ -f "$OUT/bench/RESULTS.md" ] || cp bench/RESULTS.md "$OUT/bench/RESULTS.md"
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1
PY=${PYTHON:-python3}

run() {  # run NAME SECONDS COMMAND...: output to OUT/logs/NAME.log, status and time to OUT/logs/summary.txt
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  if [ -n "${GPU_DEADLINE:-}" ]; then  # bench/gpu-run.sh's end: no command may outlive it
    local left=$((GPU_DEADLINE - $(date +%s) - 15))
    if [ "$left" -lt 45 ]; then
      echo "== $name: skipped, ${left} s left before the deadline" | tee -a "$OUT/logs/summary.txt"
      return 0
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  echo "== $name: $*" | tee -a "$OUT/logs/summary.txt"
  # --foreground: the command stays in this shell's process group, so an outer timeout reaches it too
  timeout --foreground --signal=TERM --kill-after=20 "$limit" "$@" >"$OUT/logs/$name.log" 2>&1
  local rc=$?
  echo "   exit $rc after $((SECONDS - start)) s" | tee -a "$OUT/logs/summary.txt"
  tail -n 25 "$OUT/logs/$name.log"
  return 0
}

bench() {  # bench NAME SECONDS ARGS...: python bench.py ARGS --out OUT/bench
  local name=$1 limit=$2
  shift 2
  run "$name" "$limit" "$PY" bench.py "$@" --out "$OUT/bench"
}

phase_env() {
  nvidia-smi >"$OUT/logs/nvidia-smi.txt" 2>&1
  head -n 15 "$OUT/logs/nvidia-smi.txt"
  "$PY" -m pip list 2>/dev/null | grep -i -E "^(jax|jaxlib|jax-cuda[0-9]*-(plugin|pjrt)|flax|optax|orbax-checkpoint|numpy|torch|triton|transformers|tokenizers|nvidia-cudnn-cu[0-9]*|nvidia-cublas-cu[0-9]*) " \
    | tee "$OUT/logs/versions.txt"
  "$PY" -c "import jax; print(jax.devices(), jax.default_backend())" 2>&1 | tail -n 1
}

phase_mfu() {  # the profiles by model part first: they say where the rest of the step goes
  local steps="--steps 10 --warmup 2 --no-torch" flags
  # XLA runs a profiled program without its command buffers (CUDA graphs) unless told otherwise: then the
  # trace's gaps between kernels would be the profiler's, not the step's
  XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true \
    bench p760 150 train --model 760m --seq 2048 --batch 8 $steps --profile "$OUT/profile760"
  XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true \
    bench p124 100 train --model 124m --batch 16 $steps --profile "$OUT/profile124"
  bench t760-chunk 120 train --model 760m --seq 2048 --batch 8 --loss-chunk 4096 $steps
  for flags in "--xla_gpu_enable_cublaslt=true" "--xla_gpu_enable_cudnn_layer_norm=true" \
               "--xla_gpu_enable_latency_hiding_scheduler=true"; do
    XLA_FLAGS="$flags" bench "t760${flags//[^a-z]/_}" 120 train --model 760m --seq 2048 --batch 8 $steps
  done
}

phase_fp8() {  # FP8 against bfloat16 at 760m in one run, and the plans of both
  bench t760-fp8 240 train --model 760m --seq 2048 --batch 8 --fp8 --steps 10 --warmup 2 --no-torch
  local fp8
  for fp8 in false true; do
    run "plan-760m-fp8-$fp8" 60 "$PY" train.py --plan --device H100 model=760m model.block_size=2048 \
      training.batch_size=8 model.dtype=bfloat16 model.fp8="$fp8"
  done
}

phase_fp8loss() {  # the loss of FP8_STEPS real steps of 760m with FP8 beside bfloat16's
  local fp8 steps=${FP8_STEPS:-300}
  [ -f data/pystdlib/index.json ] || run prepare 300 "$PY" data.py
  for fp8 in false true; do  # one after the other: each takes most of the GPU's memory
    rm -rf "$OUT/runs/fp8-$fp8"
    run "loss760-fp8-$fp8" 420 "$PY" train.py run_dir="$OUT/runs/fp8-$fp8" model=760m model.block_size=2048 \
      model.dtype=bfloat16 model.fp8="$fp8" training.batch_size=8 training.steps="$steps" training.lr=3e-4 \
      training.min_lr=3e-5 training.warmup_steps=50 training.log_every=10 training.eval_every="$steps" \
      training.eval_windows=64 checkpoint.every=100000
    rm -rf "$OUT/runs/fp8-$fp8/checkpoints"  # 12 GB of state: only the metrics are read
  done
  "$PY" - "$OUT/runs" <<'EOF' | tee "$OUT/logs/fp8-loss.txt"
import json, pathlib, sys
root = pathlib.Path(sys.argv[1])
def rows(fp8):
    path = root / f"fp8-{fp8}" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
def losses(rows):  # (mean training loss of the last 5 logged steps, the last validation loss)
    last, val = [r["loss"] for r in rows[-5:]], [r["val_loss"] for r in rows if "val_loss" in r]
    return sum(last) / len(last), val[-1] if val else float("nan")
runs = {fp8: rows(fp8) for fp8 in ("false", "true")}
for fp8, got in runs.items():
    if not got:
        print(f"fp8 {fp8}: FAILED, no metrics (see logs/loss760-fp8-{fp8}.log)")
        continue
    train, val = losses(got)
    print(f"fp8 {fp8}: step {got[-1]['step']}, training loss {train:.4f} (mean of the last 5 logged), val_loss {val:.4f}")
if all(runs.values()):
    (t8, v8), (t16, v16) = losses(runs["true"]), losses(runs["false"])
    print(f"fp8 / bfloat16: training loss {t8 / t16 - 1:+.2%}, val_loss {v8 / v16 - 1:+.2%} (target: within 1% at 500 steps)")
EOF
}

phase_check() {
  [ -f data/pystdlib/index.json ] || run prepare 300 "$PY" data.py
  local impls="xla dot_product cudnn pallas"  # cudnn: ALiBi as head dimensions
  for impl in $impls; do  # side by side: the GPU is shared, nothing here is timed
    rm -rf "$OUT/runs/$impl"
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 400 "$PY" train.py run_dir="$OUT/runs/$impl" \
      model.dtype=bfloat16 model.attention="$impl" training.steps=40 training.log_every=1 \
      training.eval_every=40 checkpoint.every=1000 >"$OUT/logs/check-$impl.log" 2>&1 &
  done
  wait
  "$PY" - "$OUT/runs" $impls <<'EOF' | tee "$OUT/logs/check.txt"
import json, pathlib, sys
root, impls = pathlib.Path(sys.argv[1]), sys.argv[2:]
def losses(impl):
    path = root / impl / "metrics.jsonl"
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()] if path.exists() else None
ref = losses("xla")
for impl in impls:
    got = losses(impl)
    if not got:
        print(f"{impl:12s} FAILED: no metrics (see logs/check-{impl}.log)")
        continue
    falls = sum(got[-5:]) / 5 < sum(got[:5]) / 5 - 0.5
    first = " ".join(f"{x:.3f}" for x in got[:5])
    diff = max(abs(a - b) for a, b in zip(got[:10], ref[:10])) if ref else float("nan")
    print(f"{impl:12s} steps {len(got)}: first {first} ... last {got[-1]:.3f}; falls {falls}; "
          f"max |loss - xla| over the first 10 steps {diff:.4f}")
EOF
}

phase_exact() {  # cuDNN's kernel with ALiBi's columns at 32768 positions, and no (T, T) array in a cudnn step
  bench attn32768 150 attention --seq 32768 --batch 1 --heads 2 --head-dim 96 --impls cudnn,pallas --steps 3 \
    --warmup 1
  run exact-tests 240 "$PY" -m pytest -q -p no:cacheprovider -n 0 test_attention.py \
    -k "t_by_t or within or past or splash_scales"
}

phase_attention() {  # the kernels alone at 760m's, 124m's and a long shape, whole rows and packed
  local steps="--steps 10 --warmup 2"
  bench attn760 100 attention --seq 2048 --batch 8 --impls cudnn,pallas,dot_product $steps
  bench attn8192 100 attention --seq 8192 --batch 1 --impls cudnn,pallas $steps
  bench attn124 80 attention --seq 1024 --batch 16 --heads 12 --head-dim 64 --impls cudnn,pallas $steps
  bench attn760-packed 80 attention --seq 2048 --batch 8 --packed 4 --impls pallas $steps
}

phase_train124() {  # 124m (T = 1024, B = 16): auto's choice, the loss whole and chunked, pallas beside
  local steps="--steps 10 --warmup 2 --no-torch"
  bench t124 100 train --model 124m --batch 16 $steps
  bench t124-chunk0 100 train --model 124m --batch 16 --loss-chunk 0 $steps
  bench t124-pallas 100 train --model 124m --batch 16 --attention pallas $steps
}

phase_packed() {  # a fine-tuning step (4 examples packed a row; with FCM) beside the plain step of phase train124
  local steps="--steps 10 --warmup 2 --no-torch"
  bench t124-packed 100 train --model 124m --batch 16 --packed 4 $steps
  bench t124-packed-fcm 100 train --model 124m --batch 16 --packed 4 --fcm 0.5 $steps
}

phase_train760() {  # 760m at T = 2048 (B = 8) and T = 8192 (B = 1), auto's choice
  local steps="--steps 10 --warmup 2 --no-torch"
  bench t760 150 train --model 760m --seq 2048 --batch 8 $steps
  bench t760-8192 150 train --model 760m --seq 8192 --batch 1 $steps
}

phase_muon() {  # Muon's step against AdamW's at 124m and 760m, alternated (the Newton-Schulz products in bfloat16)
  local steps="--steps 10 --warmup 2 --no-torch" opt
  for opt in adamw muon adamw muon; do
    bench "t124-$opt" 100 train --model 124m --batch 16 --optimizer "$opt" $steps
  done
  for opt in adamw muon; do
    bench "t760-$opt" 150 train --model 760m --seq 2048 --batch 8 --optimizer "$opt" $steps
  done
}

phase_dpo() {  # DPO's step against a prompt/completion step on the same tokens, at 124m
  bench "dpo-124m" 240 dpo --model 124m --batch 8 --seq 1024 --rounds 3 --steps 3
}

phase_serve() {  # serve.py's tokens/s at 1 and 16 clients on a 124m run (its weights one step from random)
  [ -f data/pystdlib/index.json ] || run prepare-default 300 "$PY" data.py
  run serve-run 240 "$PY" train.py model=124m training.steps=1 training.batch_size=8 training.warmup_steps=0 \
    checkpoint.every=1 run_dir="$OUT/runs/serve-124m"
  bench "serve-124m" 300 serve --checkpoint "$OUT/runs/serve-124m" --requests 16 --max-tokens 100 --clients 1,16
}

phase_torch() {  # PyTorch side by side with our step, at 124m and 760m
  bench t124-torch 420 train --model 124m --batch 16
  bench t760-torch 420 train --model 760m --seq 2048 --batch 8
}

phase_flags() {
  local flags
  for flags in "--xla_gpu_enable_latency_hiding_scheduler=true" "--xla_gpu_enable_triton_gemm=false" \
               "--xla_gpu_enable_command_buffer="; do
    XLA_FLAGS="$flags" bench "flags-124m${flags//[^a-z]/_}" 240 train --model 124m --batch 16 --attention cudnn --no-torch
  done
}

phase_profile() {
  bench attn760 200 attention --seq 2048 --batch 8 \
    --impls cudnn,pallas,pallas:64x64x4x3,pallas:128x64x4x3,pallas:128x128x8,pallas:64x64x8x3,pallas:32x32,pallas:64x64x4x1
  bench p760 240 train --model 760m --seq 2048 --batch 8 --attention pallas --no-torch --steps 10 --profile "$OUT/profile760"
  bench p124 200 train --model 124m --batch 16 --attention cudnn --no-torch --steps 10 --profile "$OUT/profile124"
  bench t124-pallas 150 train --model 124m --batch 16 --attention pallas --no-torch --steps 10
}

phase_memory() {
  local remat chunk
  for remat in none save_matmuls full; do
    for chunk in 0 4096; do
      bench "mem124-$remat-$chunk" 200 train --model 124m --batch 16 --attention cudnn --remat "$remat" \
        --loss-chunk "$chunk" --no-torch --steps 10
      run "plan-124m-$remat-$chunk" 60 "$PY" train.py --plan --device H100 model=124m training.batch_size=16 \
        model.dtype=bfloat16 model.attention=cudnn model.remat="$remat" training.loss_chunk="$chunk"
    done
  done
  for remat in save_matmuls full; do
    bench "mem760-$remat" 300 train --model 760m --seq 2048 --batch 8 --attention pallas --remat "$remat" \
      --loss-chunk 0 --no-torch --steps 10
    run "plan-760m-$remat" 60 "$PY" train.py --plan --device H100 model=760m model.block_size=2048 \
      training.batch_size=8 model.dtype=bfloat16 model.attention=pallas model.remat="$remat" training.loss_chunk=0
  done
}

phase_lora() {
  local model remat
  for model in tinyllama-1_1b gpt-j-6b llama-7b; do
    for remat in full none; do
      bench "lora-$model-$remat" 300 train --model "$model" --seq 2048 --batch 8 --remat "$remat" --lora 8 \
        --no-torch --steps 5 --warmup 2
      run "plan-lora-$model-$remat" 60 "$PY" train.py --plan --device H100 model="$model" model.dtype=bfloat16 \
        model.remat="$remat" training.batch_size=8 training.seq_len=2048 training.init_from=runs/base \
        training.lora.rank=8 training.lora.base_dtype=bfloat16
    done
  done
}

for phase in "$@"; do
  "phase_$phase" || echo "phase $phase failed"
done
