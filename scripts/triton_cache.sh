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
# Here, after a call that saved one: `cp <files_at>/triton-cache.tar.xz .triton-cache.tar.xz` in the
# repository root (`echo /.triton-cache.tar.xz >> .git/info/exclude` once) and name
# `.triton-cache.tar.xz` in the next call's carry. The device returns files of at most 16 MiB: a larger
# archive is refused here in one line, and the call goes on without it.
set -uo pipefail
cd "$(dirname "$0")/.."
cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
case "${1:-}" in
  restore)
    [ -f .triton-cache.tar.xz ] || exit 0
    mkdir -p "$cache"
    # Python's tarfile and lzma: the image may lack the xz binary that `tar J` needs
    if python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2], filter="data")' \
         .triton-cache.tar.xz "$cache" 2>/dev/null; then
      echo "# triton cache: $(ls "$cache" | wc -l) kernels restored from .triton-cache.tar.xz"
    else
      echo "# triton cache: .triton-cache.tar.xz did not unpack; compiling from scratch" >&2
    fi ;;
  save)
    file=${2:-${OUT:?save needs a FILE or \$OUT}/triton-cache.tar.xz}
    [ -d "$cache" ] || { echo "# triton cache: nothing at $cache to save"; exit 0; }
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "w:xz").add(sys.argv[2], arcname=".")' "$file" "$cache" \
      || { echo "# triton cache: archiving failed" >&2; rm -f "$file"; exit 0; }
    size=$(stat -c %s "$file")
    if [ "$size" -gt $(( 16 * 1024 * 1024 )) ]; then
      echo "# triton cache: $(( size / 1048576 )) MiB is over the device's 16 MiB a file; not saved" >&2
      rm -f "$file"
    else
      echo "# triton cache: $(ls "$cache" | wc -l) kernels, $(( size / 1024 )) KiB in $file"
    fi ;;
  *) echo "usage: bash scripts/triton_cache.sh restore | save [FILE]" >&2; exit 2 ;;
esac
