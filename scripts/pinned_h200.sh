#!/usr/bin/env bash
# Issue 31's H200 rows (one GPU, 139 GiB / 125 GiB): the whole GLM-5.3-Flash shape with random weights,
# pinned experts on the GPU and the rest cached on the host (docs/pinned.md). Run from the repository
# root on the H200 after the NVFP4 rows are merged (DTYPE=nvfp4; DTYPE=bf16 runs the same on a cut:
# LAYERS=14). Writes under ${OUT:-bench/results}.
#
#   bash scripts/pinned_h200.sh [plan|decode|serve|tests]...   (default: all four, in that order)
set -euo pipefail
cd "$(dirname "$0")/.."
DTYPE=${DTYPE:-nvfp4}
OUT=${OUT:-bench/results}
LAYERS_ARG=${LAYERS:+--layers $LAYERS}
MOE=$(( ${LAYERS:-45} - 3 ))  # glm-5.3-flash: three dense layers first
TRACE=$OUT/glm53-like-288.mtrace
mkdir -p "$OUT"
steps=${*:-plan decode serve tests}
for step in $steps; do
  case "$step" in
    plan)
      moetier trace synth --preset glm-5.3-like --experts 288 --layers "$MOE" --tokens 8192 --out "$TRACE"
      # both budgets, every byte; the second host must still fit by pinning more
      moetier plan --preset glm-5.3-flash $LAYERS_ARG --dtype "$DTYPE" --gpu-memory 139GiB --host-memory 125GiB \
        --trace "$TRACE" --pinned-out "$OUT/pinned-125GiB.json" | tee "$OUT/h200-pinned-plan-125GiB.txt"
      # 64 GiB: at the model's 1M-token length the KV pages (16.5 GiB) leave about 285 rows short on
      # both budgets together (the plan refuses with the numbers); at 128K tokens it fits by pinning more
      moetier plan --preset glm-5.3-flash $LAYERS_ARG --dtype "$DTYPE" --gpu-memory 139GiB --host-memory 64GiB \
        --trace "$TRACE" | tee "$OUT/h200-pinned-plan-64GiB-1M.txt" || true
      moetier plan --preset glm-5.3-flash $LAYERS_ARG --dtype "$DTYPE" --gpu-memory 139GiB --host-memory 64GiB \
        --max-model-len 131072 --trace "$TRACE" --pinned-out "$OUT/pinned-64GiB.json" \
        | tee "$OUT/h200-pinned-plan-64GiB.txt"
      moetier plan --preset glm-5.3-flash $LAYERS_ARG --dtype "$DTYPE" --gpu-memory 139GiB --host-memory 125GiB \
        | tee "$OUT/h200-pinned-plan-notrace.txt"
      ;;
    decode)
      # the slots share of the plan (mean slots per layer / 288), pinned experts from its file
      share=$(python3 -c "import json,sys; s=json.load(open(sys.argv[1]))['slots']; print(f'{100*sum(s.values())/len(s)/288:.1f}%')" \
        "$OUT/pinned-125GiB.json")
      moetier bench decode --preset glm-5.3-flash $LAYERS_ARG --dtype "$DTYPE" --trace "$TRACE" \
        --pinned-experts-file "$OUT/pinned-125GiB.json" --backends slots,hybrid --expert-budget "$share" \
        --batch 1 --batch 8 --batch 32 --repeats 3 --out "$OUT/h200-pinned-decode.json"
      ;;
    serve)
      share=$(python3 -c "import json,sys; s=json.load(open(sys.argv[1]))['slots']; print(f'{100*sum(s.values())/len(s)/288:.1f}%')" \
        "$OUT/pinned-125GiB.json")
      moetier serve --preset glm-5.3-flash $LAYERS_ARG --expert-backend slots --expert-budget "$share" \
        --pinned-experts-file "$OUT/pinned-125GiB.json" --replay-trace "$TRACE" --max-model-len 8192 &
      server=$!
      trap 'kill -INT $server 2>/dev/null || true' EXIT
      for _ in $(seq 600); do curl -sf http://127.0.0.1:8000/health >/dev/null && break; sleep 2; done
      moetier bench serve --url http://127.0.0.1:8000 --concurrency 1,4,16,64 --out "$OUT/h200-pinned-serve.json"
      curl -s http://127.0.0.1:8000/metrics | grep -E 'expert_(pinned_hits|hits|misses|overflow)_total\{layer="total"' \
        | tee "$OUT/h200-pinned-serve-hits.txt"
      kill -INT $server; wait $server || true; trap - EXIT
      ;;
    tests)
      python3 -m pytest -q -m gpu tests/test_pinned_gpu.py tests/test_gpu.py tests/test_ep_skip.py -x \
        | tee "$OUT/h200-pinned-gpu-tests.log"
      ;;
    *) echo "error: unknown step $step (plan, decode, serve, tests)" >&2; exit 2 ;;
  esac
done
