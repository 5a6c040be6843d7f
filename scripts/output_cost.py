"""Host time of one request's output processing in one engine step (engine/output.py: detokenize the
new token, check stop strings, build the cumulative RequestOutput with its metrics), by prompt and
output length; CPU only, the embedded tokenizer. A decode step pays this once per running request,
serially with the GPU, so what grows with the sequence grows every step of a long stream.

    python scripts/output_cost.py
"""

from __future__ import annotations

import time

from moetier.engine.output import OutputProcessor
from moetier.engine.request import Request, Status
from moetier.sampling_params import SamplingParams
from moetier.tokenizer import Tokenizer


def per_step_us(tok: Tokenizer, prompt_len: int, out_len: int, reps: int = 200) -> float:
    """Microseconds of process() per step for a request already `out_len` tokens into its output."""
    r = Request("a", list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=10**6), seed=0)
    r.status = Status.RUNNING
    proc = OutputProcessor(tok)
    proc.add(r)

    def step(i: int) -> None:
        r.output_ids.append(300 + i % 500)
        r.token_times.append(time.perf_counter() - r.arrival)
        proc.process(r, lambda *a: None)

    for i in range(out_len):
        step(i)
    t0 = time.perf_counter()
    for i in range(reps):
        step(i)
    return (time.perf_counter() - t0) / reps * 1e6


def main() -> None:
    from importlib.resources import files

    tok = Tokenizer.from_dir(str(files("moetier") / "assets" / "tiny-stdlib"))
    for p, o in [(128, 64), (2048, 1024), (2048, 4096), (8192, 8192)]:
        print(f"prompt {p:5d} tokens, output {o:5d} tokens: {per_step_us(tok, p, o):6.1f} us per request per step")


if __name__ == "__main__":
    main()
