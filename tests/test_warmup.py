"""engine/warmup.py's choices, on the CPU (the warm-up itself runs on CUDA only:
tests/test_gpu_compiles.py holds it to "no compile after startup")."""

from __future__ import annotations

import torch

from moetier.engine.config import EngineConfig
from moetier.engine.warmup import large_step_tokens, warm_up


def test_the_dummy_step_is_the_smallest_large_step():
    assert large_step_tokens(64, 2048) == 65
    assert large_step_tokens(16, 17) == 17
    assert large_step_tokens(64, 64) == 0  # no step can be large: nothing to warm


class Untouchable(torch.nn.Module):
    """A model whose every use fails: the warm-up must not run it."""

    def __init__(self, device: str):
        super().__init__()
        self.device = torch.device(device)

    def forward(self, *args):
        raise AssertionError("the warm-up ran the model")

    def logits(self, *args):
        raise AssertionError("the warm-up ran the model")

    def reset_experts(self):
        raise AssertionError("the warm-up reset the experts")


def test_no_warm_up_off_cuda_with_several_ranks_or_while_recording(tmp_path):
    config = EngineConfig(max_num_tokens=256)
    warm_up(Untouchable("cpu"), None, config)  # off CUDA
    warm_up(Untouchable("cuda"), None, config, parallel=True)  # several ranks
    warm_up(Untouchable("cuda"), None, EngineConfig(max_num_tokens=256, record_trace=tmp_path / "t.mtrace"))
