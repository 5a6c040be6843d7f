#!/usr/bin/env bash
# (issue 28) The old tree is an export of the commit compared against, placed at .old/ (with data/traces),
# carried with the call; per run logs go to /tmp, JSON and the summary to $OUT.
# Old tree (.old) and new tree (.) alternated: new, old, new, old ... MODE dec|res|pre|host, ROUNDS.
# host: scripts/profile_host_step.py (this tree's copy) in each tree, batch 8: the decode step's host work.
set -uo pipefail
mode=$1 rounds=$2
root=$PWD
if [ "$mode" = host ]; then
  for r in $(seq 1 "$rounds"); do
    for tree in new old; do
      dir=$PWD; [ $tree = old ] && dir=$PWD/.old
      (cd "$dir" && PYTHONPATH=$dir:/tmp/site timeout 150 python3 "$root/scripts/profile_host_step.py" "$tree$r" 8 \
        "$OUT/alt-host-$tree$r.json" > "/tmp/alt-host-$tree$r.txt" 2>&1) || tail -5 "/tmp/alt-host-$tree$r.txt"
      head -1 "/tmp/alt-host-$tree$r.txt"
    done
  done
  exit 0
fi
if [ "$mode" = dec ]; then
  args="bench decode --layers 8 --backends resident,slots,hybrid --expert-budget 50% --batch 1 --batch 8 --host-profile $PWD/bench/results/h200-cpu-experts-4b7b6ff.json"
elif [ "$mode" = res ]; then
  args="bench prefill --layers 8 --prompt-len 512 --prompt-len 2048 --batch 1 --backends resident --reps 5"
else
  args="bench prefill --layers 8 --prompt-len 512 --prompt-len 2048 --batch 1 --expert-budget 50% --backends resident,slots,uva --prefill-cache bypass --reps 3"
fi
# res and pre: every process on the same two cores, so that a host-bound row (512 tokens, resident) does not
# measure which core a process landed on; dec keeps every core (hybrid's host experts use them)
pin=()
if [ "$mode" != dec ] && command -v taskset >/dev/null; then pin=(taskset -c 2,3); fi
for r in $(seq 1 "$rounds"); do
  for tree in new old; do
    dir=$PWD; [ $tree = old ] && dir=$PWD/.old
    t0=$(date +%s)
    (cd "$dir" && PYTHONPATH=$dir:/tmp/site timeout 280 "${pin[@]}" python3 -m moetier.cli $args --out "$OUT/alt-$mode-$tree$r.json" > "/tmp/alt-$mode-$tree$r.txt" 2>&1) \
      || { echo "$mode $tree$r FAILED"; tail -5 "/tmp/alt-$mode-$tree$r.txt"; }
    echo "$mode $tree$r: $(( $(date +%s) - t0 )) s"
  done
done
python3 - "$mode" <<'PY'
import json, glob, os, statistics, sys
mode = sys.argv[1]; out = os.environ["OUT"]
runs = {os.path.basename(p)[len(f"alt-{mode}-"):-5]: json.load(open(p)) for p in sorted(glob.glob(f"{out}/alt-{mode}-*.json"))}
def key(r):
    return (r.get("backend"), r.get("budget"), r.get("batch"), r.get("prompt_len"), r.get("prefill_cache"))
table = {}
for name, d in runs.items():
    for r in d["rows"]:
        if r.get("tok_s") is None: continue
        table.setdefault(key(r), {}).setdefault(name.rstrip("0123456789"), []).append(r)
same = True
print(f"{'row':55s} {'new tok/s':>22s} {'old tok/s':>22s} {'new/old':>8s} equal")
for k, t in table.items():
    new, old = t.get("new", []), t.get("old", [])
    if not new or not old: print(k, "missing", {n: len(v) for n, v in t.items()}); continue
    mn, mo = statistics.median(x["tok_s"] for x in new), statistics.median(x["tok_s"] for x in old)
    # the counters both trees have (the new one adds prefetch_* to slots' stats): same routing, same cache.
    # host_us is a time, not a count; and the trace rows each run routed (cursor: [first, end]) are printed,
    # since a tree that moves the replay cursor differently routes different rows
    common = set.intersection(*(set(x.get("expert_stats") or {}) for x in new + old)) - {"host_us"}
    sig = lambda x: json.dumps([{k: x["expert_stats"][k] for k in common} if common else None, x.get("hit_rate")],
                               sort_keys=True, default=str)
    eq = len({sig(x) for x in new + old}) == 1
    same &= eq
    fmt = lambda v: "/".join(f"{x['tok_s']:.1f}" for x in v)
    print(f"{str(k):55s} {fmt(new):>22s} {fmt(old):>22s} {mn / mo:8.3f} {eq}")
    if not eq:
        spans = lambda v: "/".join(str(x.get("cursor")) for x in v)
        print(f"{'':55s} cursor new {spans(new)}, old {spans(old)}")
# each tree's own output check (bench/outputs.py: every row against its reference row of the same run)
for name, d in runs.items():
    checks = d.get("output_checks") or d.get("greedy_tokens_equal_to_resident")
    print(f"{name}: output checks {checks}")
json.dump({"mode": mode, "rows": {str(k): {n: [x["tok_s"] for x in v] for n, v in t.items()} for k, t in table.items()},
           "stats_equal": same}, open(f"{out}/alt-{mode}-summary.json", "w"), indent=1)
PY
