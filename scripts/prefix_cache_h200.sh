#!/usr/bin/env bash
# Prefix caching on one H200 (issue 32, docs/prefix-cache.md): one `moetier serve` per row (cache off, on,
# on with a host tier; Qwen3-30B-A3B 8 layers and GLM-5.3-Flash 4 layers, slots at 50%), `bench serve`
# shared-prefix and multi-turn against each, JSON under $OUT and a table last. Run from the repository root
# with the device wheels (fastapi, uvicorn, fla-core ...) carried in .whl/.
#
#   bash scripts/prefix_cache_h200.sh [ROW ...]     (default: every row; rows: q-off q-on q-host q-small-multi
#                                                   q-host-multi g-off g-on g-host-multi g-res-off g-res-on
#                                                   g-small-multi g-host-small; also g-host, q-on-again,
#                                                   g-res-off-sp, g-res-on-sp, g-nv-off-sp, g-nv-on-sp)
#
# q-host: a GPU pool of three prefixes' pages, so every shared-prefix hit is the host tier's (TTFT of a
# host hit against a GPU hit). q-small-multi and q-host-multi: multi-turn over a GPU pool smaller than the
# conversations, without and with a host tier. g-host-multi: g-on's multi-turn row with a host tier. g-res-off,
# g-res-on: GLM with resident experts. g-small-multi, g-host-small: GLM over a 32,768-token GPU pool, without
# and with a host tier. The device returns 8 files a call: run several rows as
#   d=$OUT; OUT=/tmp/pc bash scripts/prefix_cache_h200.sh; tar czf $d/pc.tgz -C /tmp/pc .
set -uo pipefail
ROWS=" ${*:-q-off q-on q-host q-small-multi q-host-multi g-off g-on g-host-multi g-res-off g-res-on g-small-multi g-host-small} "
out=/tmp/prefix-stages  # h200_stages.sh's header file; $OUT keeps the records only
source scripts/h200_stages.sh  # the carried wheels, PYTHONPATH, `mt`
M="${mt[*]}"
port=8100
row() {  # name, server args..., then -- bench lines separated by ';;'
  local name=$1; shift
  case "$ROWS" in *" $name "*) ;; *) return ;; esac
  local sargs=() ; while [ "$1" != "--" ]; do sargs+=("$1"); shift; done; shift
  local t0=$(date +%s)
  setsid $M serve "${sargs[@]}" --port $port > /tmp/serve-$name.txt 2>&1 &
  local pid=$!
  for i in $(seq 1 240); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 1; done
  curl -sf http://127.0.0.1:$port/health >/dev/null || { echo "$name: server did not start"; tail -5 /tmp/serve-$name.txt; kill -- -$pid 2>/dev/null; return; }
  echo "== $name (server up in $(( $(date +%s) - t0 )) s)"
  local IFS=$'\n'
  for b in $(echo "$*" | sed 's/;;/\n/g'); do
    local tag=$(echo "$b" | awk '{print $1}')
    local bargs=$(echo "$b" | cut -d' ' -f2-)
    eval timeout 200 $M bench serve --url http://127.0.0.1:$port $bargs --out $OUT/prefix-$name-$tag.json 2>&1 | grep -v "^bench serve:" | tail -4
  done
  kill -- -$pid 2>/dev/null; sleep 3; kill -9 -- -$pid 2>/dev/null; wait $pid 2>/dev/null
  echo "$name: $(( $(date +%s) - t0 )) s"
}
Q="--preset qwen3-30b-a3b --layers 8 --expert-backend slots --expert-budget 50%"
SP="shared --dataset shared-prefix --concurrency 1,16 --input-len 4160 --prefix-len 4096 --num-prefixes 4 --output-len 32 --num-prompts 16 --warmup 4"
MT="multi --dataset multi-turn --concurrency 16,64 --input-len 4608 --prefix-len 4096 --output-len 64 --turns 2 --num-prompts 128 --warmup 2"
HSP="shared --dataset shared-prefix --concurrency 1 --input-len 4160 --prefix-len 4096 --num-prefixes 4 --output-len 32 --num-prompts 16 --warmup 4"
row q-off $Q --kv-tokens 262144 --no-enable-prefix-caching -- "$SP;;$MT"
row q-on $Q --kv-tokens 262144 -- "$SP;;$MT"
# a GPU pool of three prefixes' pages: four prefixes in turn evict each other, so every hit is the host tier's
# (not in the default list) q-on's shared-prefix levels with concurrency 16 twice: whether the first c16
# level's TTFT is the cache's or a first use (a kernel compiled at its first shape)
row q-on-again $Q --kv-tokens 262144 -- "${SP/--concurrency 1,16/--concurrency 1,16,16}"
row q-host $Q --kv-tokens 12800 --kv-host-memory 8GiB -- "$HSP"
# multi-turn over a GPU pool smaller than the conversations (32,768 tokens against about 74,000), without
# and with a host tier: what the tier brings back instead of recomputing
row q-small-multi $Q --kv-tokens 32768 -- "$MT"
row q-host-multi $Q --kv-tokens 32768 --kv-host-memory 16GiB -- "$MT"
G="--preset glm-5.3-flash --layers 4 --expert-backend slots --expert-budget 50% --kv-tokens 131072"
GMT="multi --dataset multi-turn --concurrency 16,64 --input-len 4608 --prefix-len 4096 --output-len 64 --turns 2 --num-prompts 128 --warmup 2"
row g-off $G --no-enable-prefix-caching -- "$HSP;;$GMT"
row g-on $G -- "$HSP;;$GMT"
row g-host-multi $G --kv-host-memory 16GiB -- "$GMT"
# GLM with every expert on the GPU: a cached prefix's TTFT without the slot cache's misses in its last step
GR="--preset glm-5.3-flash --layers 4 --expert-backend resident --kv-tokens 131072"
row g-res-off $GR --no-enable-prefix-caching -- "$HSP;;$GMT"
row g-res-on $GR -- "$HSP;;$GMT"
# (not in the default list) the shared-prefix level alone, without and with the cache: an A/B call's rows
row g-res-off-sp $GR --no-enable-prefix-caching -- "$HSP"
row g-res-on-sp $GR -- "$HSP"
# (not in the default list) g-res-off-sp and g-res-on-sp as the field reports serve GLM-5.3-Flash: routed
# experts in NVFP4 (weight-only), dense weights bf16
GN="$GR --dtype nvfp4"
row g-nv-off-sp $GN --no-enable-prefix-caching -- "$HSP"
row g-nv-on-sp $GN -- "$HSP"
# (not in the default list) g-res-on's shared prefixes over a GPU pool of three prefixes' pages with a host
# tier, as q-host: every hit is the host tier's (TTFT of a host hit against g-res-on's GPU hit)
GH="${GR/--kv-tokens 131072/--kv-tokens 12800}"
row g-host $GH --kv-host-memory 8GiB -- "$HSP"
# GLM multi-turn over a GPU pool smaller than the conversations, without and with a host tier (pages and
# state checkpoints evicted to it)
G32="${G/--kv-tokens 131072/--kv-tokens 32768}"
row g-small-multi $G32 -- "$GMT"
row g-host-small $G32 --kv-host-memory 16GiB -- "$GMT"
python3 - <<'PY'
import json, glob, os
out = os.environ["OUT"]
print(f"{'row':20s} {'conc':>4s} {'TTFT med ms':>11s} {'engine TTFT':>11s} {'ITL med ms':>10s} {'out tok/s':>9s} {'hit %':>6s} "
      f"{'host hit tok':>12s} {'steps':>5s} {'large':>5s} {'large ms':>8s} {'out/step':>8s} {'other ms/out':>12s} fail")
# out/step: output tokens per engine step (about the sequences a step decoded); other ms/out: the steps that
# were not large, their time per output token (ITL compares alike only where out/step is alike)
for p in sorted(glob.glob(f"{out}/prefix-*.json")):
    d = json.load(open(p)); name = os.path.basename(p)[7:-5]
    for r in d["results"]:
        print(f"{name:20s} {r['max_concurrency']:>4} {r['median_ttft_ms']:11.1f} {r.get('server_ttft_ms_mean') or 0:11.1f} "
              f"{r['median_itl_ms']:10.2f} {r['output_throughput']:9.1f} {100 * r.get('prefix_cache_hit_rate', 0):6.1f} "
              f"{r.get('kv_host_hit_tokens', 0):12.0f} {r.get('engine_steps', 0):5.0f} {r.get('large_steps', 0):5.0f} "
              f"{1e3 * r.get('large_step_seconds', 0):8.1f} {r['total_output_tokens'] / max(1, r.get('engine_steps', 0)):8.1f} "
              f"{1e3 * (r.get('step_seconds', 0) - r.get('large_step_seconds', 0)) / max(1, r['total_output_tokens']):12.2f} "
              f"{r['failed'] + r['cancelled']}")
PY
