#!/usr/bin/env bash
# Triton's compile cache carried between device calls. The device machine starts bare, so every cold
# call compiles its kernels again (a GLM-5.3-Flash 4-layer server: about a minute at startup; the GPU
# suite's KDA groups: most of their first test). Compiled kernels depend on the kernel source, Triton's
# version and the GPU's architecture only (H100 and H200 are both sm_90), so a cache from one call
# serves the next; a kernel whose source changed simply compiles again.
#
#   bash scripts/triton_cache.sh restore          (there: h200_stages.sh and gpu_tests.sh run it)
#   bash scripts/triton_cache.sh save [FILE]      (there, last in a call: default $OUT/triton-cache.tar.xz)
#
# The device returns files of at most 16 MiB: a larger cache is saved as parts, FILE's name with .1,
# .2, ... before .tar.xz, whole kernels in each (scripts/triton_cache_pack.py). Here, after a call
# that saved one: copy each file from <files_at> into the repository root with a leading dot
# (triton-cache.1.tar.xz -> .triton-cache.1.tar.xz; `echo '/.triton-cache*.tar.xz' >>
# .git/info/exclude` once), remove older ones, and name every one in the next call's carry.
set -uo pipefail
cd "$(dirname "$0")/.."
cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
case "${1:-}" in
  restore)
    files=(.triton-cache.tar.xz .triton-cache.*.tar.xz)
    have=()
    for f in "${files[@]}"; do [ -f "$f" ] && have+=("$f"); done
    [ ${#have[@]} -gt 0 ] || exit 0
    # Python's tarfile and lzma: the image may lack the xz binary that `tar J` needs
    python3 scripts/triton_cache_pack.py restore "$cache" "${have[@]}" \
      || echo "# triton cache: ${have[*]} did not unpack; compiling from scratch" >&2 ;;
  save)
    file=${2:-${OUT:?save needs a FILE or \$OUT}/triton-cache.tar.xz}
    [ -d "$cache" ] || { echo "# triton cache: nothing at $cache to save"; exit 0; }
    python3 scripts/triton_cache_pack.py save "$cache" "$file" || echo "# triton cache: archiving failed" >&2 ;;
  *) echo "usage: bash scripts/triton_cache.sh restore | save [FILE]" >&2; exit 2 ;;
esac
