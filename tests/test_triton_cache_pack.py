"""scripts/triton_cache_pack.py: a compile cache larger than the device's file limit is saved as parts of
whole kernel folders, each under the limit, and restores to the same tree."""

import importlib.util
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("triton_cache_pack", ROOT / "scripts" / "triton_cache_pack.py")
pack = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pack)


def make_cache(root: Path, sizes: list[int]) -> dict[str, bytes]:
    """Kernel folders of random (incompressible) bytes: {relative path: bytes}."""
    files = {}
    for i, n in enumerate(sizes):
        d = root / f"kernel{i:02d}"
        d.mkdir(parents=True)
        for name, part in (("a.cubin", n // 2), ("b.json", n - n // 2)):
            data = os.urandom(part)
            (d / name).write_bytes(data)
            files[f"kernel{i:02d}/{name}"] = data
    return files


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_cache_that_fits_is_one_archive(tmp_path):
    files = make_cache(tmp_path / "cache", [3000, 5000])
    out = pack.save(tmp_path / "cache", tmp_path / "tc.tar.xz", limit=64 * 1024)
    assert out == [tmp_path / "tc.tar.xz"]
    assert pack.restore(tmp_path / "back", out) == 2 and tree(tmp_path / "back") == files


def test_a_larger_cache_is_parts_of_whole_kernels_under_the_limit(tmp_path):
    files = make_cache(tmp_path / "cache", [30_000, 25_000, 20_000, 18_000, 9_000, 4_000])
    limit = 40_000
    out = pack.save(tmp_path / "cache", tmp_path / "tc.tar.xz", limit=limit)
    assert len(out) >= 3 and not (tmp_path / "tc.tar.xz").exists()
    assert [p.name for p in out] == [f"tc.{i + 1}.tar.xz" for i in range(len(out))]
    assert all(p.stat().st_size <= limit for p in out)
    assert pack.restore(tmp_path / "back", out) == 6 and tree(tmp_path / "back") == files


def test_a_kernel_over_the_limit_alone_is_left_out_and_the_rest_kept(tmp_path, capsys):
    files = make_cache(tmp_path / "cache", [60_000, 5_000, 4_000])
    out = pack.save(tmp_path / "cache", tmp_path / "tc.tar.xz", limit=20_000)
    assert "over the limit; left out" in capsys.readouterr().err
    pack.restore(tmp_path / "back", out)
    assert tree(tmp_path / "back") == {k: v for k, v in files.items() if not k.startswith("kernel00")}


def test_usage_errors_exit_2(capsys):
    assert pack.main([]) == 2 and pack.main(["save", "a"]) == 2 and pack.main(["pack", "a", "b"]) == 2
    assert "usage" in capsys.readouterr().err
