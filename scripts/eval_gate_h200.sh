#!/usr/bin/env bash
# The accuracy gate on a GPU (docs/eval.md): a random-weight Qwen3-30B-A3B cut to 8 layers, written to
# disk in bf16 and in the quantized formats (the same random weights: make-checkpoint's tensors come
# from (seed, name)), the shipped tiny_stdlib tasks (the checkpoint has moetier's built-in tokenizer, the
# embedded model's), each format across resident, slots 50% and hybrid 50%, every run against bf16
# resident. Random weights: the metrics mean nothing, the differences do.
#
#   bash scripts/eval_gate_h200.sh [FORMATS] [LIMIT] [JOBS]      (records under $OUT, else ./eval-out)
#
# FORMATS: a comma list of fp8, nvfp4, int4 (default all three); bf16's three rows always run. LIMIT:
# documents per task (default 30). JOBS: servers starting at once (`moetier eval --jobs`, default 3): a
# configuration's time is mostly its server's start (15-46 s each when they started one at a time, its
# evaluation a few seconds), so starting the next ones during an evaluation is what fits twelve
# configurations in one 10-minute device call.
#
# The GPU image has pandas, pyarrow, scikit-learn, sacrebleu and aiohttp but not lm-eval: carry its wheels
# in .whl (14 MB, for Python 3.12 x86-64):
#   PKGS="lm-eval datasets dill evaluate more-itertools pytablewriter dataproperty mbstrdecoder pathvalidate
#         tabledata tcolorpy typepy chardet rouge-score nltk multiprocess tenacity" bash ../shared/tools/device-wheels.sh
#   python3 -m pip wheel -q --no-deps sqlitedict word2number -w .whl     (source-only on PyPI)
#
# Time: the checkpoints (bf16 11.2 GB, fp8 6.2, nvfp4 4.1, int4 3.8) go to /dev/shm when it has room
# (the machine's /tmp wrote at about 120 MB/s) and are made at once: about 80 s for all four. The gate
# gets what the call has left and keeps every finished run in its record. Run it alone in a call.
# Writes $OUT/eval-gate-h200.json (runs, items, verdicts), the gate's tables in $OUT/gate.log.
# Tolerances (nats per token): 0 (exact) for bf16 slots against resident; hybrid computes its host misses
# on the CPU in another summation order, so it gets a small one and reports its measured difference; the
# formats report their loss against bf16 under a loose bound, and then each format's slots must agree
# exactly with its resident, its hybrid within hybrid's bound (the check after the gate).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/eval-out}
formats=${1:-fp8,nvfp4,int4}
limit=${2:-30}
jobs=${3:-3}
for f in ${formats//,/ }; do
  case "$f" in fp8|nvfp4|int4) ;; *) echo "error: FORMATS takes fp8, nvfp4, int4 (comma list), got $f" >&2; exit 2 ;; esac
done
source scripts/h200_stages.sh
shm_free=$(df -B1G --output=avail /dev/shm 2>/dev/null | tail -1 | tr -d ' ')
[ "${shm_free:-0}" -ge 50 ] 2>/dev/null && data=/dev/shm/eval-q30b || data=/tmp/eval-q30b
echo "# checkpoints in $data (/dev/shm: ${shm_free:-?} GiB free); formats bf16 ${formats//,/ }" | tee -a "$out/stages.txt"
for d in bf16 ${formats//,/ }; do
  [ -d "$data/$d" ] || stage "ckpt-$d" 200 "${mt[@]}" make-checkpoint --preset qwen3-30b-a3b --layers 8 --dtype "$d" --out "$data/$d" &
done
wait
python3 -c "import lm_eval, lm_eval.evaluator, lm_eval.models.openai_completions, datasets; print('lm-eval', lm_eval.__version__)" 2>&1 | tail -3 | tee -a "$out/stages.txt"
HYBRID_TOL=0.05
cfg=(--compare "resident=--expert-backend resident"
     --compare "slots-50%=--expert-backend slots --expert-slots 64"
     --compare "hybrid-50%=--expert-backend hybrid --expert-slots 64" --tolerance "hybrid-50%=$HYBRID_TOL")
for f in ${formats//,/ }; do
  cfg+=(--compare "$f=--model $data/$f --expert-backend resident" --tolerance "$f=5"
        --compare "$f-slots-50%=--model $data/$f --expert-backend slots --expert-slots 64" --tolerance "$f-slots-50%=5"
        --compare "$f-hybrid-50%=--model $data/$f --expert-backend hybrid --expert-slots 64" --tolerance "$f-hybrid-50%=5")
done
# the gate gets what the call has left (a device call is 600 s); its record keeps every finished run
gate_cap=$(( 570 - ($(date +%s) - t0) ))
stage gate "$gate_cap" "${mt[@]}" eval --model "$data/bf16" --device cuda --limit "$limit" --jobs "$jobs" \
  --out "$out/eval-gate-h200.json" "${cfg[@]}"
# one format, three backends: slots scores exactly as resident, hybrid within its bound (the gate compared
# each with bf16)
python3 - "$out/eval-gate-h200.json" "$formats" "$HYBRID_TOL" <<'PY' 2>&1 | tee -a "$out/stages.txt"
import json, math, sys
from moetier.eval.gate import judge
from moetier.eval.lmeval import TaskResult
runs = {r["label"]: {t: TaskResult(**v) for t, v in r["tasks"].items()} for r in json.load(open(sys.argv[1]))["runs"]}
for f in sys.argv[2].split(","):
    for b, bound in ((f"{f}-slots-50%", 0.0), (f"{f}-hybrid-50%", float(sys.argv[3]))):
        if f not in runs or b not in runs:
            print(f"{b} against {f}: not run")
            continue
        for t, ref in runs[f].items():
            v = judge(b, t, ref, runs[b][t], bound)
            # a generation task scores no log-likelihood: its differences are the outputs alone
            ll = ("no log-likelihoods" if math.isnan(v.max_ll_diff) else
                  f"max |d ll| {v.max_ll_diff:.3g} nats, {v.max_ll_diff_per_token:.3g} per token")
            print(f"{b} against {f}, {t}: {v.problem or 'pass'} ({ll}, tolerance {bound:g}; "
                  f"{v.outputs_differing} of {v.outputs} outputs differ)")
PY
