#!/usr/bin/env bash
# Issue 31 on one H200 (139 GiB GPU, 125 GiB host), each call under 9 minutes: the whole
# GLM-5.3-Flash shape with random weights, pinned experts made on the GPU and only the cached ones on the
# host (docs/pinned.md). Run from the repository root; everything lands under $OUT, a table last.
#
#   bash scripts/pinned_h200.sh [tests] [tune] [profile] [decode] [serve] [--budget SECONDS] [--batches 1,8,32]
#       [--prefetch off,trace]
#   (default: tests, decode and serve; 540 s; batches 1, 8 and 32; prefetch off)
#
# --budget: the whole script's seconds, table included (a device call is 600 s; give less when the call
#   runs something before it). --batches: decode's batch sizes. --prefetch: decode's slots rows once per
#   next-layer expert prefetch mode (experts/prefetch.py; trace: the replayed routing's perfect guess).
#
# The trace and the plans always run (CPU, seconds). The 45-layer NVFP4 bed takes minutes to make and its
# engine minutes to warm, so on the device give decode and serve a call each: `bash scripts/pinned_h200.sh
# decode` then `... serve` (the one left gets the whole budget). Its files are more than a device call
# brings back: run it with OUT=/tmp/p31 and pack them, `tar czf $OUT/p31.tgz -C /tmp/p31 --exclude '*.mtrace' .`
#
# Carry .whl/: fla-core 0.6.0 and einops (glm5_next's KDA on CUDA) and the server's wheels, made with
#   PKGS="fastapi starlette pydantic pydantic-core annotated-types typing-inspection typing-extensions uvicorn
#     opentelemetry-api importlib-metadata sniffio openai httpx2 httpcore2 truststore distro jiter
#     prometheus-client fla-core==0.6.0 einops" bash /work/shared/tools/device-wheels.sh
# (its default list plus the last three). Without fla-core the GPU tests still run; decode and serve are skipped.
#
# Format: NVFP4 experts on the whole 45-layer model when this tree has the NVFP4 rows (issue 30), else
# FP8 experts on its first 24 layers (the whole model in FP8 is 305 GB, more than both memories hold;
# the cut is 152 GB, still more than the host holds, so the split is forced either way).
#
# Steps, each under its own time limit (steps.jsonl: exit code and seconds of each):
#   plan     (CPU, beside the tests) moetier plan at the H200's budgets: 125 GiB host with the trace,
#            without it, and 64 GiB at the model's 1M tokens (refused with the numbers) and at 128K;
#            then the split the benches run: the bench's own KV on this machine's host, with the trace
#   tune     scripts/tune_experts.py on this model's expert shape, NVFP4 rows, 1 and 8 tokens: the
#            one-token GEMV's blocks (and the grouped GEMM at one token beside them), the decode blocks
#   profile  scripts/profile_glm5_next.py: 8 layers, NVFP4 experts, slots at 50%, batch 1: the step by
#            part (KDA, MLA+indexer, mHC, routed experts, LM head, the rest), each a graph replay
#   tests    GPU tests of the split (tests/test_pinned_gpu.py: kernels, graphs, prefill, engine, random bed);
#            (the GPU suite runs them too)
#   decode   bench decode batch 1, 8, 32 over the plan's split (routing replayed from the trace);
#            reference row: the same split with top_k slots a layer, bit-exact by design (every other
#            expert a miss or overflow), each row's greedy tokens and logits checked against it
#   serve    moetier serve over its own plan's split (64 requests at once), bench serve at concurrency
#            1, 4, 16, 64; hits by kind from /metrics. The trace's cursor is shared by all requests, so the completions of two
#            levels route differently: their cross-level check is listed, not a verdict
#   table    every row beside the plan's prediction, its roofline and its reference check
set -uo pipefail
cd "$(dirname "$0")/.."
TESTS=0 DECODE=0 SERVE=0 TUNE=0 PROFILE=0 BUDGET=540 BATCHES=1,8,32 PREFETCH=off
while [ $# -gt 0 ]; do
  case "$1" in
    tests) TESTS=1 ;;
    tune) TUNE=1 ;;
    profile) PROFILE=1 ;;
    --batches) BATCHES=$2; shift ;;
    --prefetch) PREFETCH=$2; shift ;;
    decode) DECODE=1 ;;
    serve) SERVE=1 ;;
    --budget) BUDGET=$2; shift ;;
    *) echo "error: unknown argument $1 (give any of: tests tune profile decode serve, --budget SECONDS," \
            "--batches LIST, --prefetch LIST)" >&2; exit 2 ;;
  esac
  shift
done
case "$BUDGET" in ''|*[!0-9]*) echo "error: --budget takes whole seconds, got $BUDGET" >&2; exit 2 ;; esac
case "$BATCHES" in ''|*[!0-9,]*|,*|*,|*,,*) echo "error: --batches takes sizes like 1,8,32, got $BATCHES" >&2; exit 2 ;; esac
[ $((TESTS + DECODE + SERVE + TUNE + PROFILE)) -eq 0 ] && TESTS=1 DECODE=1 SERVE=1
BATCH_ARGS=()
for b in ${BATCHES//,/ }; do BATCH_ARGS+=(--batch "$b"); done
DECODE_CAP=$(( SERVE ? 190 : 420 )) SERVE_CAP=$(( DECODE ? 190 : 420 ))
OUT=${OUT:-bench/results/pinned-h200}
mkdir -p "$OUT"
: > "$OUT/steps.jsonl"
START=$(date +%s)
DEADLINE=$((START + BUDGET))  # the whole script, table included
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "error: the carried wheels in .whl/ did not install" >&2; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
MT=(python3 -m moetier.cli)
mt() { "${MT[@]}" "$@"; }

if python3 -c "from moetier.quant.registry import FORMATS; assert 'nvfp4' in FORMATS" 2>/dev/null; then
  DTYPE=nvfp4 LAYERS=45
else
  DTYPE=fp8 LAYERS=24
fi
MOE=$((LAYERS - 3))  # glm-5.3-flash: three dense layers first
MODEL=(--preset glm-5.3-flash --layers "$LAYERS" --dtype "$DTYPE")
TRACE=$OUT/glm53-like-288.mtrace
echo "issue 31 on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1): glm-5.3-flash, $LAYERS layers, $DTYPE experts; out $OUT"

# step NAME CAP RESERVE CMD...: CMD under min(CAP, what the deadline leaves after RESERVE seconds for
# the steps after it); its log in $OUT/NAME.log, its exit code and seconds in steps.jsonl
step() {
  local name=$1 cap=$2 reserve=$3 t0 rc limit
  shift 3
  t0=$(date +%s)
  limit=$((DEADLINE - t0 - reserve))
  [ "$limit" -gt "$cap" ] && limit=$cap
  if [ "$limit" -lt 10 ]; then
    echo "{\"step\": \"$name\", \"rc\": null, \"seconds\": 0, \"skipped\": \"no time left\"}" >> "$OUT/steps.jsonl"
    return 1
  fi
  if [ "$(type -t "$1")" = function ]; then  # a function of this script: it bounds its own commands
    LIMIT=$limit "$@" > "$OUT/$name.log" 2>&1
  else
    timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  fi
  rc=$?
  echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $(( $(date +%s) - t0 )), \"limit_s\": $limit}" >> "$OUT/steps.jsonl"
  echo "$name: exit $rc in $(( $(date +%s) - t0 )) s (limit $limit s)"
  return $rc
}

plans() {
  local h200=(--gpu-memory 139GiB)
  mt plan "${MODEL[@]}" "${h200[@]}" --host-memory 125GiB --trace "$TRACE" > "$OUT/plan-125GiB.txt" 2>&1
  mt plan "${MODEL[@]}" "${h200[@]}" --host-memory 125GiB --trace "$TRACE" --json > "$OUT/plan-125GiB.json"
  mt plan "${MODEL[@]}" "${h200[@]}" --host-memory 125GiB > "$OUT/plan-125GiB-notrace.txt" 2>&1
  mt plan "${MODEL[@]}" "${h200[@]}" --host-memory 64GiB --trace "$TRACE" > "$OUT/plan-64GiB-1M.txt" 2>&1
  mt plan "${MODEL[@]}" "${h200[@]}" --host-memory 64GiB --max-model-len 131072 --trace "$TRACE" --json \
    > "$OUT/plan-64GiB-128K.json"
  # the benches' split: their own KV (32 requests of 128 tokens) on this machine's host; 5 GiB of the GPU
  # left to the random bed's drawing scratch and the bench's link probes
  mt plan "${MODEL[@]}" --gpu-memory 134GiB --max-model-len 128 --max-num-seqs 32 --trace "$TRACE" --json \
    --pinned-out "$OUT/pinned-bench.json" > "$OUT/plan-bench.json"
  # the server's split, planned for its own 64 requests at once (bench serve's top level): more state
  # slots and checkpoints than the bench's 32, so fewer experts pinned
  mt plan "${MODEL[@]}" --gpu-memory 134GiB --max-model-len 128 --max-num-seqs 64 --trace "$TRACE" --json \
    --pinned-out "$OUT/pinned-serve.json" > "$OUT/plan-serve.json"
}

serve_rows() {  # under $LIMIT seconds: the server's start, the levels, its stop
  local pid ok=0 t0=$(date +%s) end=$(( $(date +%s) + LIMIT - 25 ))
  local split=$OUT/pinned-serve.json
  [ -s "$split" ] || { echo "error: the server's plan wrote no split (plan-serve.json, plan.log)"; return 1; }
  mt serve "${MODEL[@]}" --expert-backend slots --expert-slots-file "$split" --pinned-experts-file "$split" \
    --replay-trace "$TRACE" --max-model-len 128 --max-num-seqs 64 --port 8000 > "$OUT/server.log" 2>&1 &
  pid=$!
  while [ "$(date +%s)" -lt "$end" ]; do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)" 2>/dev/null \
      && { ok=1; break; }
    kill -0 "$pid" 2>/dev/null || break
    sleep 1
  done
  if [ "$ok" = 1 ]; then
    echo "server up in $(( $(date +%s) - t0 )) s (random weights made, graphs captured)"
    timeout -k 5 $(( end - $(date +%s) )) "${MT[@]}" bench serve --url http://127.0.0.1:8000 --concurrency 1,4,16,64 --input-len 32 --output-len 32 --warmup 2 \
      --out "$OUT/serve.json"
    python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8000/metrics', timeout=10).read().decode())" \
      > "$OUT/serve-metrics.txt"
  else
    echo "error: the server did not come up (server.log)"
  fi
  kill -INT "$pid" 2>/dev/null
  for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  kill -KILL "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  [ "$ok" = 1 ]
}

FLA=1
python3 -c "import fla" 2>/dev/null || { FLA=0; echo "error: fla-core is missing: glm5_next cannot run on CUDA (carry it and einops in .whl/); decode and serve skipped"; }
step trace 30 0 "${MT[@]}" trace synth --preset glm-5.3-like --experts 288 --layers "$MOE" --tokens 8192 --out "$TRACE"
plans > "$OUT/plan.log" 2>&1 &
plan_pid=$!
if [ "$TESTS" = 1 ]; then
  step tests 120 $(( (DECODE + SERVE) * 200 + (TUNE + PROFILE) * 100 )) python3 -m pytest -q -m gpu tests/test_pinned_gpu.py -p no:cacheprovider
fi
if [ "$TUNE" = 1 ]; then
  step tune 150 $(( (DECODE + SERVE) * 200 + PROFILE * 100 )) python3 scripts/tune_experts.py "$OUT/tune.json" \
    --dtypes "$DTYPE" --tokens 1,8 --preset glm-5.3-flash
fi
if [ "$PROFILE" = 1 ] && [ "$FLA" = 1 ]; then
  step profile 150 $(( (DECODE + SERVE) * 200 )) python3 scripts/profile_glm5_next.py --layers 8 --dtype "$DTYPE" \
    --backend slots --budget 0.5 --out "$OUT/profile.json"
fi
wait "$plan_pid"
echo "{\"step\": \"plan\", \"rc\": $?}" >> "$OUT/steps.jsonl"
SPLIT=$OUT/pinned-bench.json  # the plan's pins and its slots per layer, which the benches run
if [ "$FLA" = 0 ]; then
  echo "{\"step\": \"decode and serve\", \"rc\": null, \"skipped\": \"no fla-core\"}" >> "$OUT/steps.jsonl"
else
  if [ "$DECODE" = 1 ] && [ ! -s "$SPLIT" ]; then
    echo "error: the benches' plan wrote no split (plan-bench.json, plan.log): decode not run"
  elif [ "$DECODE" = 1 ]; then
    # 1%: top_k slots a layer (the fewest a layer takes), the reference row; then the plan's slots per layer
    step decode "$DECODE_CAP" $(( SERVE ? 150 : 10 )) "${MT[@]}" bench decode "${MODEL[@]}" --trace "$TRACE" \
      --pinned-experts-file "$SPLIT" --backends slots --expert-budget 1% --expert-slots-file "$SPLIT" \
      "${BATCH_ARGS[@]}" --prefetch "$PREFETCH" --tokens 32 --warmup 8 --prompt-len 32 --repeats 3 --out "$OUT/decode.json"
  fi
  [ "$SERVE" = 1 ] && step serve "$SERVE_CAP" 10 serve_rows
fi

python3 - "$OUT" "$DTYPE" "$LAYERS" <<'EOF' | tee "$OUT/table.txt"
import json, re, sys
from pathlib import Path

out, dtype, layers = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None
summary = {"dtype": dtype, "layers": int(layers), "steps": [json.loads(x) for x in (out / "steps.jsonl").read_text().split("\n") if x]}
print(f"\nissue 31, one H200: glm-5.3-flash {layers} layers, {dtype} experts, pinned on the GPU + cached on the host")
for name, what in (("plan-125GiB.json", "139 GiB / 125 GiB, trace"), ("plan-64GiB-128K.json", "139 GiB / 64 GiB, 128K tokens"),
                   ("plan-bench.json", "the benches' split (134 GiB / this host)"),
                   ("plan-serve.json", "the server's split (134 GiB / this host, 64 requests)")):
    p = load(name)
    if p is None:
        print(f"plan {what}: missing (plan.log)")
        continue
    pins, slots = sum(p["pinned_per_layer"].values()), sum(p["slots_per_layer"].values())
    e = 288 * len(p["slots_per_layer"])
    pr = p.get("prediction") or {}
    line = (f"plan {what}: {'fits' if p['fits'] else 'REFUSED'}, {pins} pinned, {slots} slots, {e - pins} cached; "
            f"GPU {p['device_total'] / 2**30:.1f} GiB, host {p['host_total'] / 2**30:.1f} GiB")
    if pr:
        line += (f"; predicted {pr['hit_rate']:.1%} hits (pinned {pr['pinned_rate'] or 0:.1%}), "
                 f"{pr['tok_per_s']:.1f} tok/s at batch 1")
    print(line)
    summary[name] = {"fits": p["fits"], "pinned": pins, "slots": slots, "cached": e - pins, "prediction": pr}
text = (out / "plan-64GiB-1M.txt").read_text().splitlines() if (out / "plan-64GiB-1M.txt").exists() else ["missing"]
split = [x for x in text if x.startswith("split: ")]
print("plan 139 GiB / 64 GiB, 1M tokens:", f"fits, {split[0]}" if split else text[0][:240])
bench = load("plan-bench.json") or {}  # the split the benches run: its pins and slots per layer
predicted = (bench.get("prediction") or {}).get("tok_per_s")
d = load("decode.json")
rows = []
if d:
    bw = d["bandwidth"]
    print(f"\ndecode (HBM {bw['hbm_GBps']:.0f} GB/s, link {bw['link_GBps']:.1f} GB/s, measured in the run)")
    print(f"{'row':22} {'tok/s':>8} {'min-max':>13} {'plan':>6} {'roofline':>8} {'of roof':>7} {'pinned':>7} {'slot':>6} "
          f"{'miss':>6} {'HBM GB':>7} {'link GB':>7} {'link t':>6}  check")
    for r in d["rows"]:
        st = r["expert_stats"]
        looked = max(1, st["hits"] + st["misses"] + st["overflow"])
        pin = st.get("pinned", 0)
        link_t = r["link_bytes_per_step"] / (bw["link_GBps"] * 1e9) * 1e3 / r["roofline_step_ms"]
        split = bool(r.get("slots_per_layer"))  # the plan's row (else the reference, top_k slots a layer)
        name = f"slots {'plan' if split else r['slots']}/layer b{r['batch']}" + (
            f" pf:{r['prefetch']}" if r.get("prefetch", "off") != "off" else "")
        plan = f"{predicted:6.1f}" if predicted and r["batch"] == 1 and split else "     -"
        check = r.get("check", {}).get("verdict", "?")
        print(f"{name:22} {r['tok_s']:8.1f} {r['tok_s_min']:6.1f}-{r['tok_s_max']:<6.1f} {plan} {r['roofline_tok_s']:8.1f} "
              f"{r['of_roofline']:7.0%} {pin / looked:7.1%} {(st['hits'] - pin) / looked:6.1%} "
              f"{(st['misses'] + st['overflow']) / looked:6.1%} {r['hbm_bytes_per_step'] / 1e9:7.2f} "
              f"{r['link_bytes_per_step'] / 1e9:7.2f} {link_t:6.0%}  {check}")
        rows.append({"row": name, "batch": r["batch"], "slots": r["slots"], "tok_s": r["tok_s"], "runs_tok_s": r["runs_tok_s"],
                     "roofline_tok_s": r["roofline_tok_s"], "of_roofline": r["of_roofline"], "pinned_share": pin / looked,
                     "link_time_share": link_t, "check": check})
    main = [r for r in d["rows"] if r.get("slots_per_layer") and r["batch"] == 1 and r.get("prefetch", "off") == "off"]
    if main:
        b1 = main[0]
        summary["targets"] = {"b1_tok_s_at_least_40": b1["tok_s"] >= 40, "b1_at_least_70pct_of_roofline": b1["of_roofline"] >= 0.7}
else:
    print("\ndecode: no record (decode.log)")
summary["decode"] = rows
s = load("serve.json")
kinds = {}
if (out / "serve-metrics.txt").exists():
    for m in re.finditer(r'^moetier:expert_(\w+?)_total\{[^}]*layer="total"[^}]*\} (\S+)', (out / "serve-metrics.txt").read_text(), re.M):
        kinds[m.group(1)] = float(m.group(2))
if s:
    print(f"\nserve (moetier serve, {s['input_len']} in / {s['output_len']} out, greedy)")
    print(f"{'concurrency':>11} {'done':>5} {'failed':>6} {'out tok/s':>9} {'TPOT ms':>8} {'TTFT ms':>8}  check across levels")
    for r in s["results"]:
        c = r.get("check", {})
        print(f"{r['max_concurrency']:>11} {r['completed']:>5} {r['failed'] + r['cancelled']:>6} {r['output_throughput']:9.1f} "
              f"{r['median_tpot_ms']:8.1f} {r['median_ttft_ms']:8.0f}  {c.get('verdict', '?')} (trace cursor shared: routing differs)")
    summary["serve"] = [{k: r[k] for k in ("max_concurrency", "completed", "failed", "cancelled", "output_throughput")} for r in s["results"]]
    top = [r for r in s["results"] if r["max_concurrency"] == 64]
    summary.setdefault("targets", {})["c64_zero_failures"] = bool(top) and top[0]["failed"] + top[0]["cancelled"] == 0
else:
    print("\nserve: no record (serve.log, server.log)")
if kinds:
    looked = max(1.0, kinds.get("hits", 0) + kinds.get("misses", 0) + kinds.get("overflow", 0))
    p = kinds.get("pinned_hits", 0)
    print(f"serve hits by kind: pinned {p / looked:.1%}, slot {(kinds['hits'] - p) / looked:.1%}, "
          f"miss {(kinds['misses'] + kinds['overflow']) / looked:.1%} of {looked:.0f} lookups")
    summary["serve_hits"] = kinds
for name in ("tune.log", "profile.log"):  # their own tables, as they printed them
    if (out / name).exists():
        text = (out / name).read_text().splitlines()
        at = next((n for n, x in enumerate(text) if x.startswith(("best per dtype", "glm-5.3-flash cut"))), None)
        print(f"\n{name}:", *(text[at:] if at is not None else text[-6:]), sep="\n  ")
tests = (out / "tests.log").read_text().strip().splitlines()[-1:] if (out / "tests.log").exists() else ["missing"]
print("GPU tests (test_pinned_gpu.py):", tests[0])
summary["tests"] = tests[0]
print("targets:", summary.get("targets", {}))
print("steps:", ", ".join(f"{x['step']} rc={x['rc']} {x.get('seconds', '?')}s" for x in summary["steps"]))
(out / "summary.json").write_text(json.dumps(summary, indent=1))
EOF
echo "total: $(( $(date +%s) - START )) s"
