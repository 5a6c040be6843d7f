#!/usr/bin/env bash
# Issue 30 on one H200, in one device call (with --no-tests under 10 minutes: every stage has its own
# time cap, set from the run at 242d551, where layer, tune and the GLM-5.3-Flash rows ran past the
# first caps; a stage that runs out leaves its record missing in the summary rather than the call): the GPU tests of
# 4-bit experts, then the benchmark rows the issue asks for, 4-bit against FP8 and bf16 side by side,
# every row checked against its reference row of the same run, and the targets' table last.
#
#   bash scripts/quant4_h200.sh [--no-tests]   (from the repository root; records under $OUT, else ./q4-out;
#                                               --no-tests: stage 1 left out, when the GPU suite ran them)
#
# Stages (records in $OUT):
#   1. pytest -m gpu tests/test_quant4_kernels.py tests/test_quant4_gpu.py tests/test_packed4_linear.py -> q4-gpu-tests.log
#      the 4-bit grouped GEMMs against the torch reference and bit-exact across resident / slots / uva;
#      graph replay against eager resident; the large step; 4-bit checkpoints through the engine
#   2. bench layer qwen3-30b-a3b --dtype bf16,fp8,nvfp4,int4                  -> layer-q4.json
#      resident per-layer time and the fill rates (copy kernel, copy engine) of each format's rows
#   3. scripts/tune_experts.py --dtypes nvfp4,int4 --tokens 1,8              -> tune-q4.json
#      the 4-bit decode blocks (GemmConfig.q4_*: bf16's until this has run)
#   4. bench decode qwen3-30b-a3b 8 layers, resident and slots at 50% / 25%, batch 1, 8, 32
#                                                                               -> decode-qwen3-q4.json
#   4b. bench decode the same, nvfp4 against nvfp4-dense (dense projections kept 4-bit), resident and
#      slots at 50%, batch 1, 8                                                  -> decode-qwen3-dense4.json
#   5. bench decode glm-5.3-flash 4 layers (3 dense, 1 MoE of 288 experts), the same rows at batch 1, 8
#      (needs fla-core: carry a .whl/ with it, PKGS=fla-core ../shared/tools/device-wheels.sh; else
#      skipped and said so)                                                     -> decode-glm53flash-q4.json
#   6. bench prefill qwen3-30b-a3b 8 layers, 2,048 tokens, resident and slots@50%, bf16 / nvfp4 / int4
#                                                                               -> prefill-q4.json
#   7. scripts/quant4_summary.py: each target's ratio and verdict, the output checks -> quant4-summary.json
# Each bench row's greedy tokens are checked against its own format's resident row (the records'
# greedy_tokens_equal_to_resident and output_checks); the summary lists any that differ.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/q4-out}
source scripts/h200_stages.sh  # wheels, PYTHONPATH, mt, stage, the header

[ "${1:-}" = --no-tests ] || stage q4-gpu-tests 140 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_quant4_kernels.py tests/test_quant4_gpu.py tests/test_packed4_linear.py
stage layer-q4 110 "${mt[@]}" bench layer --preset qwen3-30b-a3b --dtype bf16,fp8,nvfp4,int4 --no-tune --out "$out/layer-q4.json"
stage tune-q4 95 python3 scripts/tune_experts.py "$out/tune-q4.json" --dtypes nvfp4,int4 --tokens 1,8
stage decode-qwen3-q4 135 "${mt[@]}" bench decode --preset qwen3-30b-a3b --layers 8 --dtype bf16,fp8,nvfp4,int4 \
  --backends resident,slots --expert-budget 50% --expert-budget 25% --batch 1 --batch 8 --batch 32 \
  --tokens 32 --warmup 16 --out "$out/decode-qwen3-q4.json"
# dense projections kept 4-bit (--dense-weights keep) beside dequantized ones: what keeping them costs
stage decode-qwen3-dense4 60 "${mt[@]}" bench decode --preset qwen3-30b-a3b --layers 8 --dtype nvfp4,nvfp4-dense \
  --backends resident,slots --expert-budget 50% --batch 1 --batch 8 --tokens 32 --warmup 16 \
  --out "$out/decode-qwen3-dense4.json"
if python3 -c 'import fla' 2>/dev/null; then
  # GLM-5.3-Flash's routing: 288 experts, top-8, the glm-5.3-like trace's parameters, every layer id
  "${mt[@]}" trace synth --out "$out/glm53flash.mtrace" --preset glm-5.3-like --experts 288 --topk 8 --layers 45 \
    --tokens 4096 > "$out/glm53flash-trace.log" 2>&1
  stage decode-glm53flash-q4 140 "${mt[@]}" bench decode --preset glm-5.3-flash --layers 4 --trace "$out/glm53flash.mtrace" \
    --dtype bf16,fp8,nvfp4,int4 --backends resident,slots --expert-budget 50% --expert-budget 25% \
    --batch 1 --batch 8 --tokens 16 --warmup 8 --out "$out/decode-glm53flash-q4.json"
else
  echo "# decode-glm53flash-q4: skipped, fla-core is not installed (glm5_next on CUDA needs it)" | tee -a "$out/stages.txt"
fi
stage prefill-q4 40 "${mt[@]}" bench prefill --preset qwen3-30b-a3b --layers 8 --dtype bf16,nvfp4,int4 --prompt-len 2048 \
  --batch 1 --backends resident,slots --expert-budget 50% --prefill-cache bypass --reps 3 --decode-steps 0 \
  --out "$out/prefill-q4.json"
python3 scripts/quant4_summary.py "$out" | tee "$out/summary.txt"
echo "# total $(( $(date +%s) - t0 )) s" | tee -a "$out/stages.txt"
