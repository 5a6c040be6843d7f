import os
import sys
import types

import pytest


def test_ieee_fp32_dots_narrows_a_package_autotuners_and_gives_them_back():
    """Inside: TRITON_F32_DEFAULT is ieee and each autotuner of the package tries one config (the fewest
    stages, then the smallest blocks); on exit its configs and tuned choices are back and the setting gone."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    from tests.helpers import ieee_fp32_dots

    @triton.jit
    def kernel(x, BK: tl.constexpr):
        pass

    configs = [triton.Config({"BK": bk}, num_warps=w, num_stages=st) for bk in (64, 32) for w in (2, 4) for st in (3, 2)]
    tuned = triton.autotune(configs=configs, key=[])(kernel)
    tuned.cache[("k",)] = configs[0]  # a choice tuned before
    module = types.ModuleType("fakeflapkg.ops")
    module.tuned = tuned
    sys.modules["fakeflapkg.ops"] = module
    before = os.environ.get("TRITON_F32_DEFAULT")
    try:
        with ieee_fp32_dots("fakeflapkg"):
            assert os.environ["TRITON_F32_DEFAULT"] == "ieee"
            (only,) = tuned.configs
            assert (only.num_stages, only.kwargs["BK"], only.num_warps) == (2, 32, 4)
            assert tuned.cache == {}
        assert tuned.configs == configs and tuned.cache == {("k",): configs[0]}
        assert os.environ.get("TRITON_F32_DEFAULT") == before
    finally:
        del sys.modules["fakeflapkg.ops"]
