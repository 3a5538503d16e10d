#!/usr/bin/env bash
# GPU smoke test: set up, then train tiny_mixed and a 125m recipe for a few steps in bf16 on the
# GPUs of this machine, one line per run: one process with the kernels fpscale picks (auto) and with
# flash-attn off (SDPA); with several GPUs, DP over all of them under ZeRO-1 and ZeRO-3, and TP2 x DP.
# Each line names the kernels that actually ran (counted at the call: fpscale/ops/kernels.py).
# Synthetic data (no corpus needed); exits non-zero if any run failed.
#
#   bash scripts/gpu_smoke.sh                        # sets up a CUDA torch from PyPI when a GPU is present
#   FPSCALE_SMOKE_CONFIG=configs/125m_fpmamba.yaml bash scripts/gpu_smoke.sh
#   FPSCALE_SMOKE_CPU=1 bash scripts/gpu_smoke.sh     # the same runs, arguments and checks on 2 CPU
#                                                     # processes (CI): the device is the only difference
#   FPSCALE_SMOKE_CONFIG_OVERRIDES="model.layers.0.repeat=1" ...   # key=value overrides of the config's
#                                                     # runs only (CI: fewer copies of each block)
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit $?
PY=.venv/bin/python
CONFIG=${FPSCALE_SMOKE_CONFIG:-configs/125m_fpsa.yaml}
OUT=${FPSCALE_SMOKE_OUT:-$(mktemp -d /tmp/fpscale-smoke.XXXXXX)}
CPU=${FPSCALE_SMOKE_CPU:-0}
if [ "$CPU" = 1 ]; then
    export DS_ACCELERATOR=cpu
    NGPU=2
else
    if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "gpu_smoke: torch $($PY -c 'import torch; print(torch.__version__)') in .venv sees no GPU;" \
             "run bash scripts/setup.sh on the GPU machine (it installs PyPI's CUDA build of torch), or" \
             "FPSCALE_TORCH=<version> bash scripts/setup.sh for another release" >&2
        exit 1
    fi
    NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
fi
echo "gpu_smoke: $NGPU device(s), $CONFIG, runs in $OUT"
failed=0

# run NAME NPROC FLASH CONFIG [key=value ...]: two bf16 steps and a validation, then one line from
# metrics.jsonl. The sequence is 128 tokens (every shipped config's max_seq_len allows it), the
# micro-batch 2 per device.
run() {
    local name=$1 nproc=$2 flash=$3 config=$4
    shift 4
    local args=(--config "$config" data.source=synthetic data.seq_len=128 train.precision=bf16 train.steps=2
                train.warmup=1 train.log_interval=1 train.eval_interval=2 train.eval_batches=1
                train.global_batch_tokens=0 "train.global_batch=$((2 * nproc))" train.micro_batch=2
                train.resume=none train.export_final=false "train.out_dir=$OUT" "name=$name" "$@")
    if [ "$CPU" = 1 ] && [ "$flash" = 0 ]; then     # no flash-attn on a CPU: the auto run is this one
        echo "same $name (on CPU flash=0 runs what the auto run ran: SDPA)"
        return
    fi
    local launcher=("$PY")
    [ "$nproc" -gt 1 ] && launcher=("$PY" -m torch.distributed.run --standalone --nproc_per_node "$nproc")
    local t0=$SECONDS
    # --foreground: timeout stays in this script's process group, so that whoever kills the group
    # (a test that timed out) kills the run too (plain timeout makes a group of its own)
    if FPSCALE_FLASH_ATTN=$flash timeout --foreground 900 "${launcher[@]}" launch/pretrain.py "${args[@]}" \
            >"$OUT/$name.log" 2>&1; then
        $PY - "$OUT/$name/metrics.jsonl" "$name" "$flash" $((SECONDS - t0)) <<'EOF'
import json, sys
from fpscale.ops.kernels import summary
rows = [json.loads(line) for line in open(sys.argv[1])]
t = [r for r in rows if r["kind"] == "train"][-1]
v = [r for r in rows if r["kind"] == "val"][-1]
iters = " ".join(f"{n.split('.')[1]}:{s['iters_mean']:.1f}" for n, s in t["layers"].items())
mfu = f"mfu {t['mfu_executed']:.1%}/{t['mfu_nominal']:.1%}" if "mfu_executed" in t else "mfu -"
print(f"ok   {sys.argv[2]:<28} flash={sys.argv[3]:<4} loss {t['loss']:.3f} val {v['val_loss']:.3f} "
      f"{t['tokens_per_s']:>10,.0f} tok/s {mfu} mem {t['memory_gib']:.1f} GiB {sys.argv[4]} s iters {iters or '-'}"
      f"\n     ran: {summary(t['kernels'])}")
EOF
    else
        echo "FAIL $name (see $OUT/$name.log):"
        tail -n 15 "$OUT/$name.log" | sed 's/^/     /'
        failed=1
    fi
}

base=$(basename "$CONFIG" .yaml)
read -r -a over <<< "${FPSCALE_SMOKE_CONFIG_OVERRIDES:-}"
run tiny_mixed-1proc-auto 1 auto configs/tiny_mixed.yaml
run tiny_mixed-1proc-sdpa 1 0 configs/tiny_mixed.yaml
run "$base-1proc-auto" 1 auto "$CONFIG" "${over[@]}"
run "$base-1proc-sdpa" 1 0 "$CONFIG" "${over[@]}"
if [ "$NGPU" -gt 1 ]; then
    run "tiny_mixed-dp$NGPU-zero1" "$NGPU" auto configs/tiny_mixed.yaml parallel.zero_stage=1
    run "tiny_mixed-dp$NGPU-zero3" "$NGPU" auto configs/tiny_mixed.yaml parallel.zero_stage=3
    run "$base-dp$NGPU-zero1" "$NGPU" auto "$CONFIG" parallel.zero_stage=1 "${over[@]}"
    run "$base-dp$NGPU-zero3" "$NGPU" auto "$CONFIG" parallel.zero_stage=3 "${over[@]}"
    run "$base-tp2xdp$((NGPU / 2))-zero1" "$NGPU" auto "$CONFIG" parallel.tp=2 parallel.zero_stage=1 "${over[@]}"
fi
exit $failed
