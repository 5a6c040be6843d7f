#!/usr/bin/env bash
# The whole GPU suite (`pytest -m gpu tests/`) on a CUDA machine, in one or two device calls, with its
# log. Run from the repository root on the GPU machine:
#
#   bash scripts/gpu_tests.sh [--part 1/2|2/2] [--workers N] [--log FILE]
#
# --part: every other GPU test file (sorted), so the suite splits over two calls of the device's
#   10-minute limit; without it, every file. --workers N: pytest-xdist processes sharing the one
#   GPU, whole files per process (default 6; 1: in order), beside one process for each slow group;
#   -v names each test as it ends, so a run cut short by the time limit still says which failed. --log: default
#   $OUT/h200-gpu-tests.log when $OUT is set, else gpu-tests.log. The wheels the GPU image lacks
#   (fastapi, uvicorn, pydantic, openai: ../shared/tools/device-wheels.sh puts them in .whl/, carried
#   with the call) are installed into /tmp/site first, so that every test file collects.
set -uo pipefail
cd "$(dirname "$0")/.."
part="" workers=6 log="${OUT:+$OUT/h200-gpu-tests.log}"
log=${log:-gpu-tests.log}
while [ $# -gt 0 ]; do
  case "$1" in
    --part) part="$2"; shift 2 ;;
    --workers) workers="$2"; shift 2 ;;
    --log) log="$2"; shift 2 ;;
    *) echo "error: unknown argument $1 (--part 1/2|2/2, --workers N, --log FILE)" >&2; exit 2 ;;
  esac
done
case "$part" in ""|1/2|2/2) ;; *) echo "error: --part takes 1/2 or 2/2, got $part" >&2; exit 2 ;; esac
case "$workers" in ''|*[!0-9]*|0) echo "error: --workers takes a positive integer, got $workers" >&2; exit 2 ;; esac
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "error: the carried wheels in .whl/ did not install" >&2; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the project as it is here, with the image's torch
bash scripts/triton_cache.sh restore  # a carried compile cache, if any
# autotuners' winners kept in the same cache (Triton's disk cache of autotune results): on a cold H100
# the KDA group's first test took 215 s at c2aa2d8, fla's kernels compiled and autotuned there; with a
# carried cache (`bash scripts/triton_cache.sh save` after the suite) a later call can skip the sweeps
export TRITON_CACHE_AUTOTUNING=1
# the slowest files (durations of the last H200 runs: fla's compile and autotune in the first KDA
# prefill of a process, the 4-bit engine rows) run in pytest processes of their own, one per group,
# started beside the rest: xdist hands whole files out in its own order, so named first they still
# started late and the suite ran past the call limit. A group is pytest's arguments (files and a -k
# selection); its files leave the xdist run. At c471bf3 (4 workers, three groups: kda, quant4, and
# swiglu_clamp with glm5_next) the groups took 315, 354 and 272 s beside the xdist run's 310 s, each
# led by one or two tests of 120-165 s: split so that those run side by side.
SLOW_GROUPS=("tests/test_kda_gpu.py -k 'prefill_varlen and dtype0'"
             "tests/test_kda_gpu.py -k 'not (prefill_varlen and dtype0)'"
             "tests/test_quant4_gpu.py -k glm5-next" "tests/test_quant4_gpu.py -k 'not glm5-next'"
             "tests/test_glm5_next_gpu.py" "tests/test_swiglu_clamp.py")
SLOW=()
for g in "${SLOW_GROUPS[@]}"; do
  eval "args=($g)"
  for a in "${args[@]}"; do case "$a" in tests/*.py) SLOW+=("$a") ;; esac; done
done
files=(tests/)
if [ -n "$part" ]; then  # the files that hold gpu tests; every file is still collected below
  n=${part%/2}
  mapfile -t files < <(grep -l "pytest.mark.gpu" tests/test_*.py | sort | awk -v n="$n" 'NR % 2 == n % 2')
  SLOW=() SLOW_GROUPS=()
fi
xdist=()
[ "$workers" -gt 1 ] && xdist=(-n "$workers" --dist loadfile)
{
  echo "# moetier GPU suite: $(python3 -c 'import moetier.bench.common as c; print(c.commit())' 2>/dev/null || echo '?')" \
       "part=${part:-all} workers=$workers"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  echo "# files: ${files[*]}"
} > "$log"
# every test file must import here (a missing package fails the run, not only its tests)
python3 -m pytest --collect-only -q -p no:cacheprovider tests/ > /tmp/gpu-collect.log 2>&1 \
  || { cat /tmp/gpu-collect.log | tail -30 | tee -a "$log"; echo "# collection failed" >> "$log"; exit 1; }
tail -1 /tmp/gpu-collect.log | tee -a "$log"
slow_rc=0 slow_pids=()
if [ ${#SLOW[@]} -gt 0 ]; then
  # each group's log beside the main one (a run cut by the call limit keeps them), appended at the end
  for i in "${!SLOW_GROUPS[@]}"; do
    eval "args=(${SLOW_GROUPS[$i]})"
    python3 -m pytest -m gpu -v -rfEs -p no:cacheprovider --durations=10 "${args[@]}" > "$log.slow$i" 2>&1 &
    slow_pids+=($!)
  done
  ignore=()
  for f in "${SLOW[@]}"; do ignore+=(--ignore "$f"); done
  files=(tests/ "${ignore[@]}")
fi
python3 -m pytest -m gpu -v -rfEs -p no:cacheprovider --durations=20 "${xdist[@]}" "${files[@]}" 2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
for i in "${!slow_pids[@]}"; do
  wait "${slow_pids[$i]}"
  r=$?
  [ "$r" -ne 0 ] && slow_rc=$r
  { echo "# slow files, run beside the rest: ${SLOW_GROUPS[$i]} (exit $r)"; cat "$log.slow$i"; } >> "$log"
  rm -f "$log.slow$i"
done
echo "# exit code $rc (slow files: $slow_rc)" >> "$log"
[ "$rc" -ne 0 ] && exit "$rc"
exit "$slow_rc"
