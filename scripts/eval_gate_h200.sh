#!/usr/bin/env bash
# The accuracy gate on a GPU (docs/eval.md): a random-weight Qwen3-30B-A3B cut to 8 layers, written to
# disk in bf16 and in FP8 (the same random weights quantized), the shipped tiny_stdlib tasks (the
# checkpoint has moetier's built-in tokenizer, the embedded model's), across resident, slots 50% and
# hybrid, then FP8 resident and slots. Random weights: the metrics mean nothing, the differences do.
#
#   bash scripts/eval_gate_h200.sh [DATA_DIR] [LIMIT]      (needs pip install 'moetier[eval]')
#
# The GPU image has pandas, pyarrow, scikit-learn, sacrebleu and aiohttp but not lm-eval: carry its wheels
# in .whl (14 MB; checked to download for Python 3.12 x86-64, not yet imported on the GPU machine):
#   PKGS="lm-eval datasets dill evaluate more-itertools pytablewriter dataproperty mbstrdecoder pathvalidate
#         tabledata tcolorpy typepy chardet rouge-score nltk multiprocess tenacity" bash ../shared/tools/device-wheels.sh
#   python3 -m pip wheel -q --no-deps sqlitedict word2number -w .whl     (source-only on PyPI)
#
# Writes bench/results/eval-gate-h200.json (runs, items, verdicts) and prints the gate's tables.
set -euo pipefail
data=${1:-/tmp/eval-q30b}
limit=${2:-50}
[ -d "$data/bf16" ] || moetier make-checkpoint --preset qwen3-30b-a3b --layers 8 --out "$data/bf16"
[ -d "$data/fp8" ] || moetier make-checkpoint --preset qwen3-30b-a3b --layers 8 --dtype fp8 --out "$data/fp8"
mkdir -p bench/results
moetier eval --model "$data/bf16" --device cuda --limit "$limit" --out bench/results/eval-gate-h200.json \
  --compare "resident=--expert-backend resident" \
  --compare "slots-50%=--expert-backend slots --expert-slots 64" \
  --compare "hybrid-50%=--expert-backend hybrid --expert-slots 64" \
  --compare "fp8=--model $data/fp8 --expert-backend resident" \
  --compare "fp8-slots-50%=--model $data/fp8 --expert-backend slots --expert-slots 64" \
  --tolerance "fp8=5" --tolerance "fp8-slots-50%=5"
# one format, two backends: FP8 slots must score exactly as FP8 resident (the gate compares both with bf16)
python - <<'PY'
import json
runs = {r["label"]: r["tasks"] for r in json.load(open("bench/results/eval-gate-h200.json"))["runs"]}
a, b = runs["fp8"], runs["fp8-slots-50%"]
bad = [t for t in a if a[t]["lls"] != b[t]["lls"] or a[t]["outputs"] != b[t]["outputs"]]
print("fp8-slots-50% against fp8:", "exact" if not bad else f"DIFFERS on {bad}")
raise SystemExit(1 if bad else 0)
PY
