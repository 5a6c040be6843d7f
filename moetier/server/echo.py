"""`echo` on /v1/completions, as vLLM answers it: the prompt's text before the output's, and with
`logprobs` the prompt's tokens before the output's in the same arrays, the first prompt token's
logprob null (nothing predicts it). The prompt's logprobs are the engine's prompt logprobs, computed
in the prefill (engine/prompt_logprobs.py). With `max_tokens: 0` (scoring only) the response is the
prompt alone: the engine samples one token, which is left out, and counts as no completion token.

This is what every log-likelihood client sends (lm-eval's local-completions: echo, logprobs 1,
max_tokens 1, reading the prompt's token_logprobs and top_logprobs)."""

from __future__ import annotations

from moetier.engine.output import RequestOutput
from moetier.server.logprobs import LogprobFormatter
from moetier.server.protocol import CompletionRequest


class Echo:
    def __init__(self, req: CompletionRequest, prompt_ids: list[int], prompt_text: str, fmt: LogprobFormatter):
        """prompt_text: what the response's text starts with, the prompt's text when req.echo, else ""."""
        self.req, self.ids, self.fmt, self.text = req, prompt_ids, fmt, prompt_text
        self._sent = False

    def first(self, out: RequestOutput) -> bool:
        """True once: for the stream's first output, which carries the prompt's chunk before its own."""
        sent, self._sent = self._sent, True
        return not sent

    def _prompt_entries(self, out: RequestOutput) -> list[tuple | None]:
        return self.fmt.echoed(self.ids, out.prompt_logprobs, self.req.logprobs)

    def whole(self, out: RequestOutput) -> dict:
        """The non-streamed choice: prompt, then output (none when scoring only)."""
        c = out.outputs[0]
        if self.req.scoring_only:
            ids, text, finish, stop = self.ids, self.text, "length", None
        else:
            ids, text, finish, stop = self.ids + c.token_ids, self.text + c.text, c.finish_reason, c.stop_reason
        lp = None
        if self.req.logprobs is not None:
            entries = self._prompt_entries(out) + ([] if self.req.scoring_only else list(c.logprobs))
            lp = self.fmt.completion(ids, entries)
        return {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish, "stop_reason": stop}

    def prompt_chunk(self, out: RequestOutput) -> dict:
        """The stream's first chunk: the prompt's text and (with logprobs) its tokens."""
        lp = None if self.req.logprobs is None else self.fmt.completion(self.ids, self._prompt_entries(out))
        return {"index": 0, "text": self.text, "logprobs": lp, "finish_reason": None, "stop_reason": None}

    @staticmethod
    def last_chunk() -> dict:
        """A scoring-only stream's end: nothing generated."""
        return {"index": 0, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None}

    def usage(self, out: RequestOutput) -> dict:
        p = len(out.prompt_token_ids)
        c = 0 if self.req.scoring_only else len(out.outputs[0].token_ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
