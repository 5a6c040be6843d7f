"""spec/config.py: --speculative-config parsed as vLLM spells it, one line per problem; the engine
config takes the record, its JSON text or a dict (as vLLM's LLM does), and refuses what is not supported."""

from __future__ import annotations

import pytest

from moetier.errors import MoetierError
from moetier.spec.config import SpeculativeConfig, parse_speculative_config, speculative_config_of


def test_the_two_methods():
    assert parse_speculative_config('{"method": "mtp", "num_speculative_tokens": 3}') == SpeculativeConfig("mtp", 3)
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
                                 '"prompt_lookup_max": 5, "expert_aware_k": false}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max, c.expert_aware_k) == \
        ("ngram", 4, 2, 5, False)


@pytest.mark.parametrize("text,problems", [
    ("{", ["is not JSON"]),
    ("[1]", ["must be a JSON object"]),
    ('{"num_speculative_tokens": 2}', ["method is missing"]),
    ('{"method": "eagle", "num_speculative_tokens": 2}', ["method 'eagle': choose mtp"]),
    ('{"method": "mtp"}', ["num_speculative_tokens is missing"]),
    ('{"method": "mtp", "num_speculative_tokens": 0}', ["num_speculative_tokens 0"]),
    ('{"method": "mtp", "num_speculative_tokens": true}', ["num_speculative_tokens True"]),
    ('{"method": "mtp", "num_speculative_tokens": 99}', ["num_speculative_tokens 99"]),
    ('{"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_max": 4}', ["are for method ngram"]),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     ["is larger than prompt_lookup_max"]),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}', ["prompt_lookup_min 0"]),
    ('{"method": "mtp", "num_speculative_tokens": 2, "expert_aware_k": "yes"}', ["expert_aware_k 'yes'"]),
    ('{"method": "medusa", "k": 2}', ["unknown key 'k'", "method 'medusa'", "num_speculative_tokens is missing"]),
])
def test_every_problem_is_one_line(text, problems):
    with pytest.raises(MoetierError) as e:
        parse_speculative_config(text)
    lines = str(e.value).splitlines()
    assert len(lines) == len(problems)
    for line, want in zip(lines, problems):
        assert line.startswith("--speculative-config") and want in line, (line, want)


def test_the_python_api_takes_text_dicts_and_records():
    from moetier.engine.config import EngineConfig

    want = SpeculativeConfig("ngram", 2)
    for given in ('{"method": "ngram", "num_speculative_tokens": 2}', {"method": "ngram", "num_speculative_tokens": 2},
                  want):
        assert EngineConfig.of(speculative_config=given).speculative_config == want
    assert speculative_config_of(None) is None
    assert EngineConfig.of(speculative_config={"method": "mtp", "num_speculative_tokens": 1}).drafts_with_mtp
    with pytest.raises(MoetierError, match="num_speculative_tokens is missing"):
        EngineConfig.of(speculative_config={"method": "mtp"})
    with pytest.raises(MoetierError, match="must be a JSON object"):
        EngineConfig.of(speculative_config=3)
    assert EngineConfig.of(speculative_config=want, tensor_parallel_size=2).world_size == 2
    assert EngineConfig.of(speculative_config=want, record_trace="t.trace").record_trace == "t.trace"


def test_cli_refuses_with_one_line(tiny_ckpt):
    from typer.testing import CliRunner

    from moetier.cli.app import app

    # the tiny preset's checkpoint (qwen3_moe, num_nextn_predict_layers 0) has no MTP layers: refused
    # before loading, naming the way out (the default model ships one: tests/test_mtp_tiny_stdlib.py)
    for args, says in ((['{"method": "mtp", "num_speculative_tokens": 2}'], "use method ngram"),
                       (['{"method": "mtp", "num_speculative_tokens": -1}'], "num_speculative_tokens -1")):
        for command in (["generate", "hi"], ["serve"]):
            r = CliRunner().invoke(app, command + ["--model", str(tiny_ckpt), "--speculative-config"] + args)
            err = r.stderr.strip().splitlines()[-1]  # serve says what it plans first
            assert r.exit_code == 2 and err.startswith("error: "), r.output
            assert says in err
