#!/usr/bin/env bash
# Issue 33's overlapped scheduling on one GPU, in one device call (each stage under its own cap, the whole
# under 9 minutes): what flipping EngineConfig.async_scheduling on by default needs measured. Run from the
# repository root with the device wheels in .whl/; records under $OUT, a table last. The device returns
# few files: run as
#   d=$OUT; OUT=/tmp/as bash scripts/async_scheduling_h200.sh; tar czf $d/as.tgz -C /tmp/as --exclude '*.mtrace' .
#
# Stages (records in $OUT):
#   trace   trace synth --preset qwen3-30b-like --layers 8                            -> qwen3.mtrace
#   sync    bench decode qwen3-30b-a3b 8 layers: resident and slots at 50%, batch 1, 8, 32, CUDA
#           graphs, routing replayed from the trace, every row checked against resident  -> sync.json
#   async   the same with --async-scheduling                                          -> async.json
#   tests   tests/test_gpu_overlap.py (graphs with overlapped steps against the synchronous loop)
#   lmhead  scripts/lm_head_fp8_bench.py: the LM head at decode sizes, bf16 against FP8 -> lm-head.json
#   table   per row: tok/s synchronous and overlapped, their ratio, both rows' output checks
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/async-scheduling-out}
source scripts/h200_stages.sh  # wheels, PYTHONPATH, mt, stage, the header
trace=$out/qwen3.mtrace
D=(bench decode --preset qwen3-30b-a3b --layers 8 --trace "$trace" --backends resident,slots --expert-budget 50%
   --batch 1 --batch 8 --batch 32 --tokens 64 --warmup 8 --repeats 3)

stage trace 30 "${mt[@]}" trace synth --out "$trace" --preset qwen3-30b-like --layers 8 --tokens 20000
stage sync 150 "${mt[@]}" "${D[@]}" --out "$out/sync.json"
stage async 150 "${mt[@]}" "${D[@]}" --async-scheduling --out "$out/async.json"
stage tests 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_overlap.py
stage lmhead 60 python3 scripts/lm_head_fp8_bench.py "$out/lm-head.json"

python3 - "$out" <<'PY' | tee "$out/table.txt"
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
def rows(name):
    try:
        return {(r["backend"], r["budget"], r["batch"]): r for r in json.loads((out / name).read_text())["rows"]}
    except (OSError, ValueError, KeyError):
        return {}
sync, over = rows("sync.json"), rows("async.json")
print("\nasync_scheduling, qwen3-30b-a3b 8 layers, bf16, graphs (tok/s, median of repeats)")
print(f"{'row':16} {'sync':>9} {'async':>9} {'ratio':>6}  checks")
for key in sorted(sync, key=lambda k: (k[0], k[2])):
    s, a = sync[key], over.get(key)
    name = (key[0] if key[0] == "resident" else f"{key[0]} {key[1]:.0%}") + f" b{key[2]}"
    if a is None:
        print(f"{name:16} {s['tok_s']:9.1f} {'-':>9}")
        continue
    print(f"{name:16} {s['tok_s']:9.1f} {a['tok_s']:9.1f} {a['tok_s'] / s['tok_s']:6.2f}  "
          f"{s.get('check', {}).get('verdict', '?')} / {a.get('check', {}).get('verdict', '?')}")
try:
    for r in json.loads((out / "lm-head.json").read_text())["rows"]:
        print(f"lm head {r['model']:14} m={r['tokens']:<3} bf16 {r['bf16_us']:7.1f} us  fp8 {r['fp8_us']:7.1f} us  "
              f"rel err {r['rel_err']:.1e}  argmax same {r['argmax_same']:.0%}")
except (OSError, ValueError, KeyError):
    print("lm head: no record")
PY
