"""Triton's compile cache in xz archives of at most LIMIT bytes each (scripts/triton_cache.sh's save
and restore): the device returns files of at most 16 MiB, and a whole GPU suite's cache compresses
to about twice that. Kernel folders (one per compiled kernel: the cache's top-level entries) are
never split: they are dealt largest first into as many parts as the whole archive's size asks for,
each part written and, if it still passes LIMIT, dealt again into one more part.

    python scripts/triton_cache_pack.py save CACHE_DIR FILE      (FILE.tar.xz; parts FILE.1.tar.xz, ...)
    python scripts/triton_cache_pack.py restore CACHE_DIR FILE...
"""

from __future__ import annotations

import sys
import tarfile
from pathlib import Path

LIMIT = 16 * 1024 * 1024  # the device's bound on a returned file


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


def write(entries: list[Path], file: Path) -> int:
    with tarfile.open(file, "w:xz") as tar:
        for e in entries:
            tar.add(e, arcname=e.name)
    return file.stat().st_size


def deal(raw: dict[Path, int], parts: int) -> list[list[Path]]:
    """entries (raw: entry -> its bytes) into `parts` groups of about equal raw size, largest first."""
    groups: list[list[Path]] = [[] for _ in range(parts)]
    sizes = [0] * parts
    for e in sorted(raw, key=raw.get, reverse=True):
        i = sizes.index(min(sizes))
        groups[i].append(e)
        sizes[i] += raw[e]
    return [g for g in groups if g]


def save(cache: Path, file: Path, limit: int = LIMIT) -> list[Path]:
    """-> the archives written (one file when the whole fits, else numbered parts); a single kernel
    folder over the limit is left out with a line on stderr."""
    entries = sorted(cache.iterdir())
    if not entries:
        return []
    file.parent.mkdir(parents=True, exist_ok=True)
    stem = str(file).removesuffix(".tar.xz")
    whole = write(entries, file)
    if whole <= limit:
        return [file]
    file.unlink()
    parts = -(-whole // limit)
    raw = {e: size_of(e) for e in entries}
    while True:
        groups = deal(raw, parts)
        names = [Path(f"{stem}.{i + 1}.tar.xz") for i in range(len(groups))]
        sizes = [write(g, n) for g, n in zip(groups, names)]
        if all(s <= limit for s in sizes) or len(groups) < parts or parts >= len(entries):
            break
        for n in names:
            n.unlink()
        parts += 1
    kept = []
    for n, s, g in zip(names, sizes, groups):
        if s > limit:
            print(f"# triton cache: {n.name} ({s // 1048576} MiB, {len(g)} kernels) is over the limit; left out",
                  file=sys.stderr)
            n.unlink()
        else:
            kept.append(n)
    return kept


def kernels_in(file: Path) -> set[str]:
    """The kernel folders an archive holds."""
    with tarfile.open(file, "r:xz") as tar:
        return {name.split("/")[0] for name in tar.getnames()}


def restore(cache: Path, files: list[Path]) -> int:
    """Unpack every archive into cache -> the kernel folders there after."""
    cache.mkdir(parents=True, exist_ok=True)
    for f in files:
        with tarfile.open(f, "r:xz") as tar:
            tar.extractall(cache, filter="data")
    return len(list(cache.iterdir()))


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] not in ("save", "restore") or (argv[0] == "save" and len(argv) != 3):
        print("usage: triton_cache_pack.py save CACHE_DIR FILE | restore CACHE_DIR FILE...", file=sys.stderr)
        return 2
    cache = Path(argv[1])
    if argv[0] == "save":
        written = save(cache, Path(argv[2]))
        kernels = sum(len(kernels_in(p)) for p in written)
        total = sum(p.stat().st_size for p in written)
        print(f"# triton cache: {kernels} of {len(list(cache.iterdir()))} kernels, {total // 1024} KiB in "
              + ", ".join(p.name for p in written) if written else "# triton cache: nothing saved")
    else:
        print(f"# triton cache: {restore(cache, [Path(f) for f in argv[2:]])} kernels after restoring "
              + ", ".join(Path(f).name for f in argv[2:]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
