"""4-bit checkpoints through the `moetier` command as a user runs it (issue 30): make-checkpoint
--dtype nvfp4 on qwen3_moe, deepseek_v3 and glm5_next tiny shapes, then `moetier generate --model DIR`:
the same greedy tokens as the checkpoint dequantized to float32 by the torch references; the load
report says once that the experts stay 4-bit and compute weight-only, and once that a checkpoint's
activation scales are never read."""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_cli import run
from tests.test_quant4_checkpoint import dequantized_copy

GEN = ("--max-tokens", "5", "--ignore-eos", "--dtype", "float32")


def tokens(path, *extra):
    p = run("generate", "The experts", "--model", str(path), *GEN, "--json", *extra)
    out = json.loads(p.stdout)
    return out["token_ids"], out["load_notes"]


@pytest.mark.parametrize("preset,dtype,fmt", [("tiny", "nvfp4", None), ("tiny-dsv3", "nvfp4", None),
                                               ("tiny-glm5-next", "nvfp4", None),
                                               ("tiny-dsv3", "nvfp4", "compressed-tensors"), ("tiny", "int4", None)])
def test_generate_on_a_4bit_checkpoint_equals_its_dequantized_reference(tmp_path, preset, dtype, fmt):
    path = tmp_path / "q"
    run("make-checkpoint", "--preset", preset, "--dtype", dtype, *(("--format", fmt) if fmt else ()),
        "--out", str(path), "--seed", "2")
    got, notes = tokens(path)
    want, ref_notes = tokens(dequantized_copy(path, tmp_path / "ref"))
    assert got == want and len(got) == 5
    assert sum(f"routed experts stay {dtype}" in n and "W4A16" in n for n in notes) == 1 and not ref_notes
    assert not any("never read" in n for n in notes)  # no activation scales in this checkpoint


def test_generate_says_once_that_input_scales_are_never_read(tmp_path):
    """ModelOpt's W4A4 calibration on every linear (input_scale): the same tokens, and one log line."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "q"
    run("make-checkpoint", "--preset", "tiny", "--dtype", "nvfp4", "--out", str(path))
    want, _ = tokens(path)
    f = path / "model.safetensors"
    t = load_file(f)
    for name in [n for n in t if n.endswith(".weight_scale_2")]:
        t[name.removesuffix(".weight_scale_2") + ".input_scale"] = torch.tensor(float("nan"))  # any read: NaN
    save_file(t, f)
    got, _ = tokens(path)
    assert got == want
    p = run("generate", "The experts", "--model", str(path), *GEN)
    lines = p.stderr.splitlines()
    assert sum("never read" in line for line in lines) == 1, p.stderr
    assert sum(line.startswith("load: routed experts stay nvfp4") for line in lines) == 1, p.stderr
