"""spec/config.py: --speculative-config parsed as vLLM spells it, one line per problem; a run that
asks for speculation is told it is not wired yet (CLI: one line, exit 2)."""

from __future__ import annotations

import pytest

from moetier.errors import MoetierError
from moetier.spec.config import NOT_WIRED, SpeculativeConfig, parse_speculative_config, refuse_unwired


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


def test_unwired_is_refused_with_one_line():
    refuse_unwired(None)
    with pytest.raises(MoetierError, match="not yet wired") as e:
        refuse_unwired(SpeculativeConfig("ngram", 2))
    assert str(e.value) == NOT_WIRED and "\n" not in NOT_WIRED


def test_engine_config_and_cli_refuse_with_one_line():
    from typer.testing import CliRunner

    from moetier.cli.app import app
    from moetier.engine.config import EngineConfig

    with pytest.raises(MoetierError, match="not yet wired"):
        EngineConfig.of(speculative_config=SpeculativeConfig("mtp", 2))
    with pytest.raises(MoetierError, match="speculative_config must be"):
        EngineConfig.of(speculative_config={"method": "mtp"})
    for args, says in ((['{"method": "mtp", "num_speculative_tokens": 2}'], "not yet wired"),
                       (['{"method": "mtp", "num_speculative_tokens": -1}'], "num_speculative_tokens -1")):
        for command in (["generate", "hi"], ["serve"]):
            r = CliRunner().invoke(app, command + ["--speculative-config"] + args)
            err = r.stderr.strip()
            assert r.exit_code == 2 and err.startswith("error: --speculative-config") and "\n" not in err, r.output
            assert says in err
