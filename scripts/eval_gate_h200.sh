#!/usr/bin/env bash
# The accuracy gate on a GPU (docs/eval.md): a random-weight Qwen3-30B-A3B cut to 8 layers, written to
# disk in bf16 and in FP8 (the same random weights quantized), the shipped tiny_stdlib tasks (the
# checkpoint has moetier's built-in tokenizer, the embedded model's), across resident, slots 50% and
# hybrid, then FP8 resident and slots. Random weights: the metrics mean nothing, the differences do.
#
#   bash scripts/eval_gate_h200.sh [DATA_DIR] [LIMIT]      (records under $OUT, else ./eval-out)
#
# The GPU image has pandas, pyarrow, scikit-learn, sacrebleu and aiohttp but not lm-eval: carry its wheels
# in .whl (14 MB, for Python 3.12 x86-64):
#   PKGS="lm-eval datasets dill evaluate more-itertools pytablewriter dataproperty mbstrdecoder pathvalidate
#         tabledata tcolorpy typepy chardet rouge-score nltk multiprocess tenacity" bash ../shared/tools/device-wheels.sh
#   python3 -m pip wheel -q --no-deps sqlitedict word2number -w .whl     (source-only on PyPI)
#
# Time: the four checkpoints are about 25 GB; on the H200 machine bf16's 11.2 GB took 92 s (its /tmp
# wrote at about 120 MB/s), the quantized ones were CPU-bound until make-checkpoint made tensors on
# every core. Run it alone in a call (not beside the GPU suite).
# Writes $OUT/eval-gate-h200.json (runs, items, verdicts), the gate's tables in $OUT/gate.log. The same
# random weights in every format (make-checkpoint's tensors come from (seed, name)); nvfp4 and int4 rows
# too. Tolerances: 0 (exact) for slots against resident; hybrid computes its host misses on the CPU in
# another summation order, so it gets a small one and reports its measured difference; the formats
# report their loss against bf16 under a loose bound, and one format's two backends must agree exactly.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/eval-out}
source scripts/h200_stages.sh
# the checkpoints (about 25 GB) in memory when /dev/shm has room for them twice over (writing them to
# /tmp took much of the call: the header's Time), else in /tmp
shm_free=$(df -B1G --output=avail /dev/shm 2>/dev/null | tail -1 | tr -d ' ')
[ "${shm_free:-0}" -ge 50 ] 2>/dev/null && default_data=/dev/shm/eval-q30b || default_data=/tmp/eval-q30b
data=${1:-$default_data}
echo "# checkpoints in $data (/dev/shm: ${shm_free:-?} GiB free)" | tee -a "$out/stages.txt"
limit=${2:-30}
# the four at once: each is bound by one core for part of its run (the quantizers), the machine has 16
for d in bf16 fp8 nvfp4 int4; do
  [ -d "$data/$d" ] || stage "ckpt-$d" 200 "${mt[@]}" make-checkpoint --preset qwen3-30b-a3b --layers 8 --dtype "$d" --out "$data/$d" &
done
wait
python3 -c "import lm_eval, lm_eval.evaluator, lm_eval.models.openai_completions, datasets; print('lm-eval', lm_eval.__version__)" 2>&1 | tail -3 | tee -a "$out/stages.txt"
# the gate gets what the call has left (a device call is 600 s); its record keeps every finished run
gate_cap=$(( 570 - ($(date +%s) - t0) ))
stage gate "$gate_cap" "${mt[@]}" eval --model "$data/bf16" --device cuda --limit "$limit" --out "$out/eval-gate-h200.json" \
  --compare "resident=--expert-backend resident" \
  --compare "slots-50%=--expert-backend slots --expert-slots 64" \
  --compare "hybrid-50%=--expert-backend hybrid --expert-slots 64" \
  --compare "fp8=--model $data/fp8 --expert-backend resident" \
  --compare "fp8-slots-50%=--model $data/fp8 --expert-backend slots --expert-slots 64" \
  --compare "nvfp4=--model $data/nvfp4 --expert-backend resident" \
  --compare "nvfp4-slots-50%=--model $data/nvfp4 --expert-backend slots --expert-slots 64" \
  --compare "int4=--model $data/int4 --expert-backend resident" \
  --tolerance "hybrid-50%=0.05" --tolerance "fp8=5" --tolerance "fp8-slots-50%=5" \
  --tolerance "nvfp4=5" --tolerance "nvfp4-slots-50%=5" --tolerance "int4=5"
# one format, two backends: slots must score exactly as resident (the gate compares both with bf16)
python3 - "$out/eval-gate-h200.json" <<'PY' 2>&1 | tee -a "$out/stages.txt"
import json, sys
runs = {r["label"]: r["tasks"] for r in json.load(open(sys.argv[1]))["runs"]}
for a, b in (("fp8", "fp8-slots-50%"), ("nvfp4", "nvfp4-slots-50%")):
    if a in runs and b in runs:
        bad = [t for t in runs[a] if runs[a][t]["lls"] != runs[b][t]["lls"] or runs[a][t]["outputs"] != runs[b][t]["outputs"]]
        print(f"{b} against {a}:", "exact" if not bad else f"DIFFERS on {bad}")
PY
