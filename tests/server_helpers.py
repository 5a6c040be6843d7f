"""A live server for tests: the app under uvicorn on a free loopback port, in a background thread,
over a real engine on the default model; and a scripted engine whose replies are fixed text (the
tiny model cannot be made to write `</think>` or `<tool_call>`), so the parsers are tested through
the whole HTTP path with replies chosen by the test."""

from __future__ import annotations

import asyncio
import shutil
import socket
import threading
import time

import pytest
from pathlib import Path

import uvicorn

from moetier.engine.async_llm import AsyncLLM
from moetier.engine.llm import LLM
from moetier.engine.output import CompletionOutput, RequestOutput
from moetier.server.app import build_app
from moetier.tokenizer.detokenizer import StreamDecoder

# A Qwen3-style template: tools in a system block, and a prompt that ends in an open <think> unless
# chat_template_kwargs says enable_thinking false (then an empty, closed think block, as Qwen3 writes).
THINK_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a function by writing <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""


def think_model(tmp: Path) -> Path:
    """The default model with the thinking template above."""
    from moetier.default_model import default_model_dir

    out = tmp / "tiny-think"
    shutil.copytree(default_model_dir(), out)
    (out / "chat_template.jinja").write_text(THINK_TEMPLATE)
    return out


def marker_model(tmp: Path, markers: tuple[str, ...]) -> Path:
    """A random tiny model with the thinking template whose tokenizer makes `markers` special tokens,
    as GLM's and DeepSeek's checkpoints do (the default model's 448-token vocabulary has no room)."""
    from moetier.checkpoint.writer import make_checkpoint
    from moetier.tokenizer.synthetic import write_marker_tokenizer

    out = tmp / "tiny-markers"
    make_checkpoint(out, "tiny", dtype="float32")
    write_marker_tokenizer(out, markers)
    (out / "chat_template.jinja").write_text(THINK_TEMPLATE)
    return out


class ScriptedEngine(AsyncLLM):
    """An AsyncLLM whose replies are `script`, token by token through the real tokenizer and detokenizer."""

    script = ""

    async def generate(self, prompt, params=None, request_id=None):
        tok = self.llm.tokenizer
        ids = tok.encode(self.script)
        decoder, text = StreamDecoder(tok, keep=params.keep_special_ids if params else frozenset()), ""
        for i, t in enumerate(ids):
            last = i == len(ids) - 1
            delta = decoder.push(t) + (decoder.flush() if last else "")
            text += delta
            out = CompletionOutput(0, text, ids[:i + 1], "stop" if last else None, None, delta)
            yield RequestOutput(request_id, None, list(prompt), [out], last, {})
            await asyncio.sleep(0)


class LiveServer:
    def __init__(self, engine: AsyncLLM, name: str = "tiny-stdlib", **options):
        self.engine, self.llm = engine, engine.llm
        self.app = build_app(engine, name, **options)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)

    def client(self, api_key: str = "none", **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, **kw)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def serve(model=None, engine_cls=AsyncLLM, name: str = "tiny-stdlib", llm_options: dict | None = None,
          **options) -> LiveServer:
    return LiveServer(engine_cls(LLM(model, **(llm_options or {}))), name, **options)


def wait_idle(llm: LLM, timeout: float = 10.0) -> None:
    """Until no request holds pages (an abort reaches the engine thread between steps)."""
    deadline = time.time() + timeout
    while llm.scheduler.cache.num_in_use or llm.scheduler.running or llm.scheduler.waiting:
        assert time.time() < deadline, (f"{llm.scheduler.cache.num_in_use} KV pages still held, "
                                        f"{len(llm.scheduler.running)} requests running")
        time.sleep(0.02)
    llm.scheduler.check()


@pytest.fixture(scope="module")
def live():
    """A module's server on the default model (imported by the test files that use it)."""
    server = serve(llm_options={"max_model_len": 512})
    yield server
    server.close()
