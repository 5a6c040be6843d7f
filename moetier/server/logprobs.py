"""Log-probabilities in the OpenAI response formats, from the engine's per-token entries
(CompletionOutput.logprobs: (logprob of the sampled token, [(alternative id, logprob)] most likely
first)). A token's text is its own decoding, which for a piece of a multi-byte character is the
replacement character, as vLLM reports it; `bytes` are that text's UTF-8 bytes."""

from __future__ import annotations

from typing import Any


class LogprobFormatter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        t = self._text.get(token_id)
        if t is None:
            t = self._text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return t

    def completion(self, token_ids: list[int], entries: list[tuple], offset: int = 0) -> dict[str, Any]:
        """/v1/completions: tokens, token_logprobs, top_logprobs (the alternatives, by text) and
        text_offset (each token's start in the text, from `offset`)."""
        tokens, offsets = [], []
        for t in token_ids:
            offsets.append(offset)
            tokens.append(self.text(t))
            offset += len(tokens[-1])
        top = [{self.text(i): lp for i, lp in alts} for _, alts in entries]
        return {"tokens": tokens, "token_logprobs": [lp for lp, _ in entries],
                "top_logprobs": top if any(alts for _, alts in entries) else None, "text_offset": offsets}

    def chat(self, token_ids: list[int], entries: list[tuple]) -> dict[str, Any]:
        """/v1/chat/completions: content = [{token, logprob, bytes, top_logprobs: [...]}]."""
        def one(token_id: int, lp: float) -> dict[str, Any]:
            text = self.text(token_id)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        content = [{**one(t, lp), "top_logprobs": [one(i, a) for i, a in alts]}
                   for t, (lp, alts) in zip(token_ids, entries)]
        return {"content": content, "refusal": None}
