#!/usr/bin/env bash
# The one GPU command: install without replacing the machine's torch and transformers (no network: nothing but
# wheels/ at the repository root), make a small model, check float32 parity / bfloat16 closeness / CUDA graphs
# on against off against transformers on the same GPU, the same for a tiny MoE model (qwen3_moe: float32 parity,
# CUDA graphs on = off, the grouped Triton expert kernel inside the graphs), a tiny sliding + sinks model (gpt_oss:
# attention sinks in the paged kernels, windows on every other layer, its biased clamped experts) and a tiny MLA
# model (deepseek_v3: the latent pages, absorbed attention), measure one throughput pair beside transformers'
# continuous batching, TP=2 and a weight push where two GPUs are visible, and print one summary table.
#
#   benchmarks/gpu_proof.sh [--out DIR]               on a GPU machine
#   benchmarks/gpu_proof.sh --cpu-dry-run [--out DIR] the same entry points on the CPU, tiny and quick
#
# Time budget: 420 s (LIMIT_S), the sum of the step limits: install 40, make-model 30, parity 100, moe-parity 30,
# sinks-parity 25, mla-parity 25, throughput-tp1 80, throughput-tp2 50, weight-push-tp2 40; a step past
# its limit is killed and fails.
# The weight push talks to a `lockstep serve` over ZeroMQ: it is skipped where pyzmq is missing (carry it:
# benchmarks/gpu_wheels.sh). Python: $PYTHON, else `python`, else `python3`. docs/gpu.md says more.
#
# Exit status 0 when every check passes. Every step's log is in DIR (default: a new temporary folder).
set -uo pipefail

DRY=0
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-dry-run) DRY=1 ;;
    --out) OUT="$2"; shift ;;
    *) echo "usage: $0 [--cpu-dry-run] [--out DIR]" >&2; exit 2 ;;
  esac
  shift
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$(mktemp -d /tmp/gpu_proof.XXXXXX)}"
mkdir -p "$OUT"
: >"$OUT/steps.tsv"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-$(command -v python || command -v python3)}"
LIMIT_S=420  # the sum of the step limits below
SCALE=1  # the CPU dry run checks the plumbing, not the GPU's budget: each step gets 3x its time (a loaded CI machine)

now() { date +%s.%N; }
# step NAME TIMEOUT_S CMD...: run CMD with a bounded time, log to OUT/NAME.log, record it in steps.tsv
step() {
  local name="$1" limit=$(( $2 * SCALE )); shift 2
  local t0 rc note="" secs
  echo "== $name (at most ${limit}s): $*"
  t0=$(now)
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  secs=$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && note="timed out after ${limit}s"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$secs" "$note" >>"$OUT/steps.tsv"
  grep -E '^\[(PASS|FAIL|info)\]|ratio|Traceback|Error' "$OUT/$name.log" | tail -n 6
  echo "   exit $rc in ${secs}s (log: $OUT/$name.log)"
  return "$rc"
}
skip() { printf '%s\t200\t0\t%s\n' "$1" "skipped: $2" >>"$OUT/steps.tsv"; echo "== $1 skipped: $2"; }

if [ "$DRY" -eq 1 ]; then
  DEVICE=cpu; SIZE=tiny; NGPU=0; SCALE=3
  PARITY_ARGS=(--prompts 2 --new-tokens 4)
  MOE_ARGS=(--prompts 2 --new-tokens 4 --no-tokenizer)  # the checks feed token ids: no BPE training a step
  BENCH_ARGS=(--pairs 1 --num-prompts 4 --min-len 8 --max-len 16 --new-tokens 4 --dtype float32)
else
  NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
  if [ "${NGPU:-0}" -lt 1 ]; then
    echo "no CUDA device visible: run with --cpu-dry-run to check the plumbing on a CPU" >&2
    exit 2
  fi
  DEVICE=cuda:0; SIZE=small
  PARITY_ARGS=(--prompts 16 --new-tokens 32)
  MOE_ARGS=(--prompts 8 --new-tokens 16)
  BENCH_ARGS=(--pairs 1 --num-prompts 256 --min-len 16 --max-len 128 --new-tokens 128 --dtype bfloat16)
fi
echo "gpu_proof: device $DEVICE, $NGPU GPU(s), out $OUT"

# 1. install: only lockstep itself (no deps), plus missing light deps from wheels/, never torch/transformers
step install 40 "$PY" benchmarks/gpu_install.py --out "$OUT/install.json" $([ "$DRY" -eq 1 ] && echo --dry-run)

# 2. a small model, made here (no network); the dry run's without a tokenizer (no step reads one)
MODEL="$OUT/model-$SIZE"
step make-model 30 "$PY" -m launch.cli make-model "$MODEL" --arch llama --size "$SIZE" --seed 0 \
  $([ "$DRY" -eq 1 ] && echo --no-tokenizer)

# 3. correctness on this device: float32 parity, bfloat16 closeness, graphs on vs off
step parity 100 "$PY" benchmarks/gpu_parity.py --model "$MODEL" --device "$DEVICE" --json "$OUT/parity.json" \
  "${PARITY_ARGS[@]}"

# 3b. a tiny MoE model (made here): float32 parity, graphs on = off (bfloat16 logprobs), no bursts
step moe-parity 30 "$PY" benchmarks/gpu_parity.py --model "$OUT/model-moe-tiny" --make-arch qwen3_moe --label MoE \
  --no-bursts --device "$DEVICE" --json "$OUT/moe_parity.json" "${MOE_ARGS[@]}"

# 3c. a tiny gpt-oss model (made here): sinks on every layer, a window on every other one (shorter than the long
# prompts), biased clamped experts; float32 parity, graphs on = off, no bursts
step sinks-parity 25 "$PY" benchmarks/gpu_parity.py --model "$OUT/model-gpt-oss-tiny" --make-arch gpt_oss \
  --label gpt-oss --no-bursts --device "$DEVICE" --json "$OUT/sinks_parity.json" "${MOE_ARGS[@]}"

# 3c. a tiny DeepSeek-V3 (made here): multi-head latent attention over latent-only pages, its MoE; as 3b
step mla-parity 25 "$PY" benchmarks/gpu_parity.py --model "$OUT/model-mla-tiny" --make-arch deepseek_v3 --label MLA \
  --no-bursts --device "$DEVICE" --json "$OUT/mla_parity.json" "${MOE_ARGS[@]}"

# 4. one throughput pair beside transformers' continuous batching, same device and dtype
step throughput-tp1 80 "$PY" benchmarks/throughput.py --model "$MODEL" --device "$DEVICE" --json "$OUT/tp1.json" \
  "${BENCH_ARGS[@]}"

# 5. TP=2 and a weight push (through `lockstep serve`, so pyzmq), where two GPUs are visible
if [ "$NGPU" -ge 2 ]; then
  step throughput-tp2 50 "$PY" -m torch.distributed.run --nproc-per-node 2 benchmarks/throughput.py \
    --model "$MODEL" --json "$OUT/tp2.json" --skip-transformers "${BENCH_ARGS[@]}"
  if "$PY" -c 'import zmq' 2>/dev/null; then
    step weight-push-tp2 40 "$PY" benchmarks/weight_update.py --model "$MODEL" --tp 2 --repeats 1
  else
    skip weight-push-tp2 "no pyzmq here (benchmarks/gpu_wheels.sh carries it): the push needs lockstep serve"
  fi
else
  why="$([ "$DRY" -eq 1 ] && echo "CPU dry run" || echo "only $NGPU GPU visible"): TP=2 needs two GPUs"
  skip throughput-tp2 "$why"
  skip weight-push-tp2 "$why"
fi

"$PY" benchmarks/gpu_summary.py "$OUT" --limit-s "$LIMIT_S" $([ "$DRY" -eq 1 ] && echo --dry-run)
