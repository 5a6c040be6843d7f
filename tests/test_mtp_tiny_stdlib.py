"""The MTP layer the embedded tiny-stdlib ships (qwen3_moe, DeepSeek-V3's MTP shape: models/mtp.py,
trained by scripts/train_mtp.py): it loads, its draft logits match transformers 5.24's MtpModel over
Qwen3MoeDecoderLayer, drafting with it gives plain greedy decoding's tokens, and it keeps drafts
on held-out text where an untrained layer of the same shape does not."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moetier.checkpoint.loader import load_model
from moetier.default_model import ASSET
from moetier.engine.llm import LLM
from moetier.sampling_params import SamplingParams
from tests.test_mtp import _run
from tests.test_parity import rel_err

N = 4  # tiny-stdlib's decoder layers: its MTP layer is layer 4
SPEC = {"method": "mtp", "num_speculative_tokens": 2, "expert_aware_k": False}
# tokens per target step at k = 2 on the snippet below: issue 35's target on held-out text, which the
# shipped layer clears and an untrained one (keeping almost no drafts: about 1.0) cannot
BOUND = 1.6


def _mtp_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if k.startswith(f"model.layers.{N}.")}


def _snippet() -> list[int]:
    """The first 96 tokens of a held-out file (held_out.txt), or of a fixed Python text where this
    Python's standard library lacks it."""
    from moetier.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(ASSET)
    f = Path(sysconfig.get_paths()["stdlib"]) / "genericpath.py"
    text = f.read_text(encoding="utf-8") if f.is_file() else (
        '"""Path operations common to more than one OS."""\nimport os\nimport stat\n\n'
        "def exists(path):\n    try:\n        os.stat(path)\n    except (OSError, ValueError):\n"
        "        return False\n    return True\n\n\ndef isfile(path):\n    try:\n        st = os.stat(path)\n")
    return tok.encode(text)[:96]


def _tokens_per_step(llm: LLM, prompt: list[int], n: int) -> tuple[list[int], float]:
    steps = llm.steps
    out = llm.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))[0].outputs[0].token_ids
    return out, (len(out) - 1) / (llm.steps - steps - 1)  # the prefill samples the first token


def test_shipped_mtp_layer_loads_and_is_skipped_without_the_flag():
    cfg, model, _ = load_model(ASSET, dtype="float32", mtp=True)
    assert cfg.num_nextn_predict_layers == 1 and len(model.mtp) == 1
    assert cfg.moe_layers == [0, 1, 2, 3, N] and model.kv_spec().num_layers == N + 1
    assert len(model.moe_blocks()) == N + 1
    plain_cfg, plain, _ = load_model(ASSET, dtype="float32")
    assert len(plain.mtp) == 0 and plain_cfg.moe_layers == [0, 1, 2, 3] and plain.kv_spec().num_layers == N
    assert cfg.num_parameters() > plain_cfg.num_parameters()
    for name, p in plain.named_parameters():  # the base is the same either way
        assert torch.equal(p, dict(model.named_parameters())[name])


def test_shipped_mtp_draft_logits_match_transformers():
    """transformers loads the shipped checkpoint as a plain Qwen3MoeForCausalLM (the MTP tensors
    ignored); its MtpModel over it, given the shipped MTP tensors, drafts what moetier drafts."""
    from transformers import Qwen3MoeForCausalLM
    from transformers.cache_utils import MtpCache
    from transformers.modeling_layers import MtpModel

    ref = Qwen3MoeForCausalLM.from_pretrained(ASSET, dtype=torch.float32).eval()
    assert len(ref.model.layers) == N
    ref.config.num_mtp_layers = 1
    mtp = MtpModel(ref, 1).eval()
    own = {k.removeprefix(f"model.layers.{N}."): v.float() for k, v in _mtp_tensors(ASSET).items()}
    experts = range(ref.config.num_experts)
    state = {"mtp_block.mlp.experts.gate_up_proj": torch.stack(
                 [torch.cat([own.pop(f"mlp.experts.{x}.gate_proj.weight"), own.pop(f"mlp.experts.{x}.up_proj.weight")])
                  for x in experts]),
             "mtp_block.mlp.experts.down_proj": torch.stack([own.pop(f"mlp.experts.{x}.down_proj.weight")
                                                             for x in experts])}
    for k, v in own.items():
        k = "post_norm." + k.removeprefix("shared_head.norm.") if k.startswith("shared_head.norm.") else k
        state[k if k.split(".")[0] in ("enorm", "hnorm", "eh_proj", "post_norm") else "mtp_block." + k] = v
    mtp.layers[0].load_state_dict(state, strict=True)

    model = load_model(ASSET, dtype="float32", mtp=True)[1]
    ids = torch.tensor(_snippet()[:24])
    hidden, (ours,) = _run(model, ids, 1)
    with torch.no_grad():
        want_hidden = ref.model(ids[None]).last_hidden_state[0]
        pos = torch.arange(1, len(ids))[None]
        h = mtp.forward_layer(0, want_hidden[None, :-1], pos, MtpCache(config=mtp.config), input_ids=ids[None, 1:])
        theirs = mtp._project_to_logits(h)[0].float()
    assert rel_err(hidden, want_hidden) <= 1e-5
    assert rel_err(ours, theirs) <= 1e-5
    assert rel_err(ours, model.logits(hidden[:-1])) > 1e-2  # the MTP layer is not the model's own head


def _untrained(tmp: Path) -> Path:
    """A copy of tiny-stdlib whose MTP layer is untrained (transformers' init: normal, std 0.02; norms 1)."""
    shutil.copytree(ASSET, tmp)
    with safe_open(str(ASSET / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    g = torch.Generator().manual_seed(0)
    for k, t in _mtp_tensors(ASSET).items():
        tensors[k] = (torch.ones_like(t) if t.dim() == 1 else
                      (torch.randn(t.shape, generator=g) * 0.02).to(t.dtype))
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return tmp


@pytest.mark.parametrize("trained", [True, False])
def test_mtp_drafting_gives_greedy_tokens_and_keeps_drafts_when_trained(tmp_path, trained):
    path = ASSET if trained else _untrained(tmp_path / "untrained")
    prompt = _snippet()
    want = LLM(None, device="cpu").generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))
    llm = LLM(str(path), device="cpu", speculative_config=SPEC)
    got, per_step = _tokens_per_step(llm, prompt, 40)
    assert got == want[0].outputs[0].token_ids
    assert llm.metrics()["spec_decode_num_draft_tokens"] > 0
    assert (per_step >= BOUND) if trained else (per_step < BOUND)
