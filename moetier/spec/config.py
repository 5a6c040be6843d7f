"""--speculative-config, spelled as vLLM spells it: a JSON object such as

    {"method": "mtp", "num_speculative_tokens": 3}
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}

parsed into one record and checked, every problem one line naming the fix (MoetierError, exit 2 at
the CLI). "mtp" drafts with the checkpoint's own multi-token-prediction layers (models/mtp.py:
deepseek_v3, glm_moe_dsa, and qwen3_moe checkpoints that store one such as the embedded
tiny-stdlib; see docs/speculative.md for glm5_next); "ngram" drafts by prompt lookup
(spec/ngram.py) for any model. "expert_aware_k" (default true) lets the engine choose k per step
between 0 and num_speculative_tokens from spec/expert_k.py's cost model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from moetier.errors import MoetierError

METHODS = ("mtp", "ngram")
MAX_SPECULATIVE_TOKENS = 16  # above this the verify step's union of experts is the whole layer
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "expert_aware_k")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1  # ngram: the shortest suffix looked up in the sequence
    prompt_lookup_max: int = 3  # ngram: the longest
    expert_aware_k: bool = True


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_speculative_config(text: str | dict[str, Any], option: str = "--speculative-config") -> SpeculativeConfig:
    """The record from the option's JSON text (or an already decoded object)."""
    if isinstance(text, str):
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise MoetierError(f"{option} is not JSON ({e.msg} at character {e.pos}); give an object like "
                               "'{\"method\": \"mtp\", \"num_speculative_tokens\": 2}'") from None
    else:
        d = text
    if not isinstance(d, dict):
        raise MoetierError(f"{option} must be a JSON object like '{{\"method\": \"mtp\", \"num_speculative_tokens\": "
                           f"2}}', got {type(d).__name__}")
    problems = [f"{option}: unknown key {k!r}; the keys are {', '.join(KEYS)}" for k in sorted(set(d) - set(KEYS))]
    method = d.get("method")
    if method not in METHODS:
        problems.append(f"{option}: method {method!r}: choose mtp (the model's own MTP layers) or ngram (prompt "
                        "lookup)" if method is not None else f"{option}: method is missing; give mtp or ngram")
    k = d.get("num_speculative_tokens")
    if k is None:
        problems.append(f"{option}: num_speculative_tokens is missing; give the most draft tokens per step "
                        f"(1 to {MAX_SPECULATIVE_TOKENS})")
    elif not _count(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        problems.append(f"{option}: num_speculative_tokens {k!r}: give a whole number from 1 to "
                        f"{MAX_SPECULATIVE_TOKENS}")
    lo, hi = d.get("prompt_lookup_min", 1), d.get("prompt_lookup_max", 3)
    if method != "ngram" and ("prompt_lookup_min" in d or "prompt_lookup_max" in d):
        problems.append(f"{option}: prompt_lookup_min and prompt_lookup_max are for method ngram; remove them")
    for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
        if not _count(v) or v < 1:
            problems.append(f"{option}: {name} {v!r}: give a whole number of at least 1")
    if _count(lo) and _count(hi) and lo > hi:
        problems.append(f"{option}: prompt_lookup_min {lo} is larger than prompt_lookup_max {hi}; give min <= max")
    aware = d.get("expert_aware_k", True)
    if not isinstance(aware, bool):
        problems.append(f"{option}: expert_aware_k {aware!r}: give true or false")
    if problems:
        raise MoetierError("\n".join(problems))
    return SpeculativeConfig(method, k, lo, hi, aware)


def speculative_config_of(value: Any, option: str = "speculative_config") -> SpeculativeConfig | None:
    """The record from what a caller gave: None (off), a SpeculativeConfig, or the JSON text or dict
    vLLM's LLM(speculative_config=...) takes."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, (str, dict)):
        return parse_speculative_config(value, option)
    raise MoetierError(f"{option} must be a JSON object (text or dict) like {{\"method\": \"ngram\", "
                       f"\"num_speculative_tokens\": 2}}, got {type(value).__name__}")
