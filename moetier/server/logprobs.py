"""Log-probabilities in the OpenAI response formats, from the engine's per-token entries
(CompletionOutput.logprobs: (logprob of the sampled token, [(alternative id, logprob)] most likely
first); RequestOutput.prompt_logprobs: (logprob, rank, alternatives) per prompt token, None for the
first). A token's text is its own decoding, which for a piece of a multi-byte character is the
replacement character, as vLLM reports it; `bytes` are that text's UTF-8 bytes. A logprob of -inf
(a token the model rules out) is reported as -9999.0, as vLLM and OpenAI do (JSON has no infinity)."""

from __future__ import annotations

from typing import Any

FLOOR = -9999.0


class LogprobFormatter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        t = self._text.get(token_id)
        if t is None:
            t = self._text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return t

    def completion(self, token_ids: list[int], entries: list[tuple | None], offset: int = 0) -> dict[str, Any]:
        """/v1/completions (OpenAI's legacy format, as vLLM fills it): tokens, token_logprobs,
        top_logprobs (per token its own logprob and the alternatives', by text) and text_offset (each
        token's start in the text, from `offset`). An entry None (the echoed prompt's first token, which
        nothing predicts) gives null logprobs."""
        tokens, offsets = [], []
        for t in token_ids:
            offsets.append(offset)
            tokens.append(self.text(t))
            offset += len(tokens[-1])
        top = [None if e is None else {self.text(t): max(e[0], FLOOR),
                                       **{self.text(i): max(lp, FLOOR) for i, lp in e[1]}}
               for t, e in zip(token_ids, entries)]
        return {"tokens": tokens, "token_logprobs": [None if e is None else max(e[0], FLOOR) for e in entries],
                "top_logprobs": top, "text_offset": offsets}

    def echoed(self, prompt_ids: list[int], scored: list[tuple | None], n: int) -> list[tuple | None]:
        """The prompt's entries (logprob, rank, alternatives) as output entries with n alternatives."""
        return [None if e is None else (e[0], e[2][:n]) for e in scored[:len(prompt_ids)]]

    def prompt(self, prompt_ids: list[int], scored: list[tuple | None], n: int) -> list[dict | None]:
        """vLLM's prompt_logprobs: per prompt token {token id: {logprob, rank, decoded_token}} for the
        token itself and its n most likely alternatives (ranks 1..n), None for the first token."""
        def one(token_id: int, lp: float, rank: int) -> tuple[str, dict]:
            return str(token_id), {"logprob": max(lp, FLOOR), "rank": rank, "decoded_token": self.text(token_id)}

        return [None if e is None else
                dict([one(t, e[0], e[1])] + [one(i, lp, r + 1) for r, (i, lp) in enumerate(e[2][:n])])
                for t, e in zip(prompt_ids, scored)]

    def chat(self, token_ids: list[int], entries: list[tuple]) -> dict[str, Any]:
        """/v1/chat/completions: content = [{token, logprob, bytes, top_logprobs: [...]}]."""
        def one(token_id: int, lp: float) -> dict[str, Any]:
            text = self.text(token_id)
            return {"token": text, "logprob": max(lp, FLOOR), "bytes": list(text.encode())}

        content = [{**one(t, lp), "top_logprobs": [one(i, a) for i, a in alts]}
                   for t, (lp, alts) in zip(token_ids, entries)]
        return {"content": content, "refusal": None}
