"""Request bodies of the OpenAI API, checked, and the error object every refusal carries.

Bodies are parsed here rather than by fastapi's own validation, whose refusals are 422s in another
shape: every bad request gets OpenAI's `{"error": {message, type, param, code}}` with 400 (or 404 for
an unknown model). Unknown fields are ignored, as vLLM and OpenAI do, so clients that send more
(`presence_penalty: 0`, `user`) keep working; fields we cannot honour yet are refused by name rather
than silently ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, StrictStr,
                      ValidationError)

from moetier.errors import MoetierError
from moetier.sampling_params import LOGIT_BIAS_MAX, MAX_LOGPROBS, SamplingParams



def _number(value: Any) -> Any:
    # one message for a number field ("abc" is not "a valid integer", as a union's first member says)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("should be a number")
    return value


Number = Annotated[float, BeforeValidator(_number)]
ROLES = ("system", "user", "assistant", "tool")


class ApiError(Exception):
    """A refusal: HTTP status, OpenAI error type, message and the offending parameter."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             503: "server_overloaded"}

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind,
                          "param": self.param, "code": self.status}}


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[StrictStr] = None
    max_tokens: Optional[StrictInt] = None
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    top_k: Optional[StrictInt] = None
    seed: Optional[StrictInt] = None
    n: StrictInt = 1
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: StrictBool = False
    presence_penalty: Optional[Number] = None
    frequency_penalty: Optional[Number] = None
    logit_bias: Optional[dict[StrictStr, Number]] = None  # token id (a JSON key: a string) -> bias

    def output_limit(self) -> int | None:
        return self.max_tokens

    def check(self) -> None:
        if self.n != 1:
            raise ApiError(400, f"n={self.n}: moetier returns one choice per request; send n=1 (or several "
                                "requests)", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                raise ApiError(400, f"{name} is not supported yet; leave it out or send 0", name)
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options needs stream: true", "stream_options")
        self.token_bias()

    def token_bias(self, vocab: int | None = None) -> dict[int, float] | None:
        """logit_bias as {token id: bias}, checked: ids whole numbers (in [0, vocab) when vocab is
        given), biases in [-100, 100]."""
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                token = -1
            if token < 0 or (vocab is not None and token >= vocab):
                where = "a token id" if vocab is None else f"a token id in [0, {vocab})"
                raise ApiError(400, f"logit_bias key {key!r} is not {where}", "logit_bias")
            if not -LOGIT_BIAS_MAX <= bias <= LOGIT_BIAS_MAX:  # NaN fails this too
                raise ApiError(400, f"logit_bias[{key!r}] = {bias}: a bias must be in [-100, 100]", "logit_bias")
            out[token] = float(bias)
        return out

    def sampling(self, default_max: int, vocab: int | None = None) -> SamplingParams:
        """SamplingParams, checked; OpenAI's defaults (temperature 1) where a field is absent."""
        limit = self.output_limit()
        if limit is not None and limit < 1:
            raise ApiError(400, f"max_tokens must be at least 1, got {limit}", "max_tokens")
        top_k = self.top_k if self.top_k is not None else 0
        if top_k == -1:  # vLLM's spelling of "off"
            top_k = 0
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        params = SamplingParams(
            max_tokens=limit if limit is not None else default_max,
            temperature=float(self.temperature if self.temperature is not None else 1.0),
            top_p=float(self.top_p if self.top_p is not None else 1.0), top_k=top_k, seed=self.seed,
            stop=stop, ignore_eos=self.ignore_eos, logprobs=self.wanted_logprobs(),
            prompt_logprobs=self.wanted_prompt_logprobs(), logit_bias=self.token_bias(vocab))
        try:
            return params.validate()
        except MoetierError as e:
            name = next((n for n in ("prompt_logprobs", "logprobs") if n in str(e)), None)
            raise ApiError(400, str(e), name) from None

    def wanted_logprobs(self) -> int | None:
        """Alternatives per token to report (0: the sampled token's logprob only), None: no logprobs."""
        return None

    def wanted_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token to compute in the prefill, None: the prompt is not scored."""
        return None


class CompletionRequest(_Common):
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]
    logprobs: Optional[StrictInt] = None
    echo: StrictBool = False
    prompt_logprobs: Optional[StrictInt] = None  # vLLM's extension: choices[].prompt_logprobs
    best_of: Optional[StrictInt] = None
    suffix: Optional[StrictStr] = None

    @property
    def scoring_only(self) -> bool:
        """max_tokens 0 with echo: the prompt back with its logprobs, nothing generated (the engine
        samples one token, which the response leaves out, as vLLM does)."""
        return self.echo and self.max_tokens == 0

    def output_limit(self) -> int | None:
        return 1 if self.scoring_only else self.max_tokens

    def check(self) -> None:
        super().check()
        for name in ("logprobs", "prompt_logprobs"):  # named here: echo turns logprobs into prompt logprobs too
            n = getattr(self, name)
            if n is not None and not 0 <= n <= MAX_LOGPROBS:
                raise ApiError(400, f"{name} must be in 0..{MAX_LOGPROBS}, got {n}", name)
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(400, "max_tokens 0 scores the prompt without generating: it needs echo: true",
                           "max_tokens")
        if self.stream and self.prompt_logprobs is not None:
            raise ApiError(400, "prompt_logprobs is returned with the whole response only; send stream: false "
                                "(or echo: true with logprobs, which streams)", "prompt_logprobs")
        if self.best_of not in (None, 1):
            raise ApiError(400, "best_of is not supported; leave it out", "best_of")
        if self.suffix:
            raise ApiError(400, "suffix is not supported; leave it out", "suffix")

    def wanted_logprobs(self) -> int | None:
        return self.logprobs

    def wanted_prompt_logprobs(self) -> int | None:
        # echo reports the prompt's tokens with the output's logprobs: as many alternatives as either asks
        asked = [n for n in (self.prompt_logprobs, self.logprobs if self.echo else None) if n is not None]
        return max(asked) if asked else None

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ApiError(400, f"{len(p)} prompts in one request: send one prompt per request", "prompt")
            p = p[0]
        if not p:
            raise ApiError(400, "the prompt is empty", "prompt")
        return p


def text_part(part: Any, where: str) -> str:
    """The text of one OpenAI content part; any other part (image_url, input_image, video_url,
    input_audio, file, ...) is refused by name: moetier serves text only, a text-only model or a
    multimodal checkpoint whose vision tower it skips (docs/models.md)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return part["text"]
    if kind == "text":
        raise ApiError(400, f"{where} is a text part without a string 'text'", "messages")
    named = f"a part of type {kind!r}" if isinstance(kind, str) else "a part without a string 'type'"
    raise ApiError(400, f"{where} is {named}: this server serves text only (the model is text-only, or a "
                        "multimodal checkpoint whose vision tower moetier skips); send text parts "
                        "({'type': 'text', 'text': ...}) or a string", "messages")


class ChatRequest(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: Optional[StrictBool] = None
    top_logprobs: Optional[StrictInt] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], dict[str, Any]]] = None
    parallel_tool_calls: Optional[StrictBool] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    response_format: Optional[dict[str, Any]] = None

    def wanted_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if self.tool_choice == "required" or isinstance(self.tool_choice, dict):
            raise ApiError(400, "tool_choice 'required' or a named function needs guided decoding, which "
                                "moetier does not have yet; use 'auto' or 'none'", "tool_choice")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise ApiError(400, "response_format other than text needs guided decoding, which moetier does "
                                "not have yet", "response_format")
        for i, tool in enumerate(self.tools or []):
            fn = tool.get("function")
            if tool.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ApiError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                                    "'parameters': {...}}}}", "tools")

    def template_messages(self) -> list[dict]:
        """Messages for the chat template: text parts joined, tool-call arguments as objects
        (Qwen3's template prints objects; OpenAI clients send JSON strings)."""
        out = []
        for i, m in enumerate(self.messages):
            if not isinstance(m.get("role"), str):
                raise ApiError(400, f"messages[{i}] needs a string 'role'", "messages")
            if m["role"] not in ROLES:
                raise ApiError(400, f"messages[{i}].role {m['role']!r}: choose one of {', '.join(ROLES)}", "messages")
            m = dict(m)
            content = m.get("content")
            if content is None and not (m["role"] == "assistant" and m.get("tool_calls")):
                raise ApiError(400, f"messages[{i}].content is missing or null: only an assistant message with "
                                    "tool_calls may leave it out", "messages")
            if isinstance(content, list):
                parts = (text_part(part, f"messages[{i}].content[{j}]") for j, part in enumerate(content))
                m["content"] = "".join(parts)  # no separator between parts (vLLM puts a newline)
            elif content is None:
                m["content"] = ""
            elif not isinstance(content, str):
                raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")
            calls = []
            for call in m.get("tool_calls") or []:
                fn = dict((call or {}).get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass  # the template prints a string as it is
                calls.append({**call, "function": fn})
            if calls:
                m["tool_calls"] = calls
            out.append(m)
        return out


def parse(model: type[BaseModel], raw: bytes) -> Any:
    """A request record from a body, or ApiError(400) naming what is wrong."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"{where}: {msg} (got {json.dumps(err.get('input'), default=str)[:80]})",
                       where.split(".")[0] or None) from None
    if hasattr(req, "check"):
        req.check()
    return req
