"""Which reasoning and tool-call parsers a server uses: the registries, by vLLM's names (so that a
`--tool-call-parser glm45` that works with vLLM works here), and each model family's default.

    tool-call parsers   hermes (Qwen3's <tool_call>{json}</tool_call>), glm45 and glm47 (GLM's
                        <arg_key>/<arg_value> calls, one grammar for both), deepseek_v3 and
                        deepseek_v31 (DeepSeek's <｜tool▁calls▁begin｜> section, both call forms), none
    reasoning parsers   qwen3, glm45, deepseek_r1, deepseek_v3 (all the <think>...</think> split, which
                        sees both a prompt-opened and a model-opened <think>; reasoning.py), none

`auto` (the default of both options) is the family's default: qwen3_moe hermes + qwen3, glm_moe_dsa
and glm5_next glm45 + glm45, deepseek_v3 deepseek_v3 + deepseek_v3; another family gets hermes +
qwen3. `none` turns a parser off: tool-call text, or the think block, stays in the content.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetier.errors import MoetierError
from moetier.server.reasoning import ReasoningSplitter, prompt_opens_reasoning
from moetier.server.tools import BlockToolParser, HermesToolParser
from moetier.server.tools_deepseek import DeepSeekToolParser
from moetier.server.tools_glm import GlmToolParser

AUTO, NONE = "auto", "none"

TOOL_CALL_PARSERS: dict[str, type[BlockToolParser] | None] = {
    "hermes": HermesToolParser,
    "glm45": GlmToolParser,
    "glm47": GlmToolParser,
    "deepseek_v3": DeepSeekToolParser,
    "deepseek_v31": DeepSeekToolParser,
    NONE: None,
}
# every reasoning format of these families is the same <think> split; the names are vLLM's
REASONING_PARSERS: dict[str, bool] = {"qwen3": True, "glm45": True, "deepseek_r1": True, "deepseek_v3": True,
                                      NONE: False}

# model_type -> (tool-call parser, reasoning parser)
FAMILY_DEFAULTS: dict[str, tuple[str, str]] = {
    "qwen3_moe": ("hermes", "qwen3"),
    "glm_moe_dsa": ("glm45", "glm45"),
    "glm5_next": ("glm45", "glm45"),
    "deepseek_v3": ("deepseek_v3", "deepseek_v3"),
}
FALLBACK = ("hermes", "qwen3")


def tool_call_parser_names() -> list[str]:
    return [AUTO, *TOOL_CALL_PARSERS]


def reasoning_parser_names() -> list[str]:
    return [AUTO, *REASONING_PARSERS]


@dataclass(frozen=True)
class Parsers:
    """The two parser choices of a server (--tool-call-parser, --reasoning-parser), checked here once."""

    tool_call: str = AUTO
    reasoning: str = AUTO

    def __post_init__(self) -> None:
        for flag, value, names in (("--tool-call-parser", self.tool_call, tool_call_parser_names()),
                                   ("--reasoning-parser", self.reasoning, reasoning_parser_names())):
            if value not in names:
                raise MoetierError(f"{flag} {value!r} is not a parser moetier has; choose one of {', '.join(names)}")

    def for_family(self, model_type: str | None) -> "Parsers":
        """These choices with `auto` replaced by the family's default."""
        tool, reasoning = FAMILY_DEFAULTS.get(model_type, FALLBACK)
        return Parsers(tool if self.tool_call == AUTO else self.tool_call,
                       reasoning if self.reasoning == AUTO else self.reasoning)

    def splitter(self, prompt: str) -> ReasoningSplitter:
        """A reasoning splitter for one reply to the rendered prompt."""
        return ReasoningSplitter(prompt_opens_reasoning(prompt), enabled=REASONING_PARSERS[self._named(self.reasoning)])

    def tool_parser(self, tools: list[dict] | None) -> BlockToolParser | None:
        """A tool-call parser for one reply (None: the reply's content is not searched for calls)."""
        cls = TOOL_CALL_PARSERS[self._named(self.tool_call)]
        return None if cls is None or not tools else cls(tools)

    @staticmethod
    def _named(value: str) -> str:
        if value == AUTO:
            raise ValueError("resolve `auto` with for_family() before making parsers")
        return value
