# Sourced by the scripts/*_h200.sh runs (after `cd` to the repository root and setting $out): installs
# the carried wheels in .whl/ (those the GPU image lacks) into /tmp/site, puts the tree on PYTHONPATH,
# defines `mt` (the CLI) and `stage`, and writes the machine's header to $out/stages.txt.
# The device tool returns at most 8 files a call: point the script elsewhere and pack, e.g.
#   d=$OUT; OUT=/tmp/rec bash scripts/quant4_h200.sh; tar czf $d/records.tgz -C /tmp/rec .
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "warning: the carried wheels in .whl/ did not install" >&2
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
bash scripts/triton_cache.sh restore  # a carried compile cache, if any
mt=(python3 -m moetier.cli)
t0=$(date +%s)
stage() {  # stage NAME SECONDS COMMAND...: run with a time cap, log to $out/NAME.log, say how it ended
  local name=$1 cap=$2; shift 2
  local s=$(date +%s)
  timeout --signal=INT --kill-after=10 "$cap" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "# $name: exit $rc after $(( $(date +%s) - s )) s (cap $cap s; total $(( $(date +%s) - t0 )) s)" | tee -a "$out/stages.txt"
  [ "$rc" -eq 124 ] && echo "#   $name ran past its cap: its record is partial or missing" | tee -a "$out/stages.txt"
  tail -3 "$out/$name.log"
}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  # the tree's commit as moetier records it (the stamped moetier/_build_info.json): the device copy's .git
  # can be an earlier one's
  python3 -c 'import moetier.bench.common as c; print("commit", c.commit())' 2>/dev/null
} | tee "$out/stages.txt"
