#!/usr/bin/env bash
# A base commit's package for an A/B in one device call (the candidate is the carried tree itself):
#
#   bash scripts/ab_tree.sh REF [DIR]      (here, before the call; DIR default ab/<REF's short hash>)
#
# writes DIR/moetier (REF's moetier/, from git archive) with its stamp (DIR/moetier/_build_info.json:
# REF's commit, clean), so the records of the base name REF, and DIR/data (REF's data/, about 6.5 MB:
# the package finds its default traces beside itself, cli/bench_common.REPO_TRACE; without them the base's
# `bench prefill` on Qwen3 stopped at "no such file"); the top folder of DIR goes to
# .git/info/exclude, so name it in the call's carry. On the device machine:
#
#   (cd DIR && PYTHONPATH=$PWD:/tmp/site python3 -m moetier.cli bench ...)   # a module: run from DIR
#   PYTHONPATH=$PWD/DIR:/tmp/site python3 scripts/x.py ...                  # a script: PYTHONPATH first
#
# `python -m` puts the working directory before PYTHONPATH on sys.path: a base run as a module from
# the repository root imports the candidate's moetier/ instead, and both records name the candidate.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] && [ $# -le 2 ] || { echo "usage: bash scripts/ab_tree.sh REF [DIR]" >&2; exit 2; }
commit=$(git rev-parse --verify -q "$1^{commit}") || { echo "error: $1 is no commit of this repository" >&2; exit 2; }
dir=${2:-ab/$(git rev-parse --short "$commit")}
case "$dir" in /*|..*|*/..*) echo "error: DIR $dir: give a folder inside the repository" >&2; exit 2 ;; esac
top=${dir%%/*}
grep -qx "/$top/" .git/info/exclude 2>/dev/null || echo "/$top/" >> .git/info/exclude
rm -rf "$dir/moetier" "$dir/data"
mkdir -p "$dir"
paths=(moetier)
git cat-file -e "$commit:data" 2>/dev/null && paths+=(data)
git archive "$commit" "${paths[@]}" | tar -x -C "$dir"
printf '{\n "commit": "%s",\n "dirty": false,\n "dirty_paths": [],\n "stamped": "%s"\n}\n' "$commit" \
  "$(date -u '+%Y-%m-%d %H:%M:%S UTC')" > "$dir/moetier/_build_info.json"
echo "$dir/moetier: $commit (carry \"$top\")"
