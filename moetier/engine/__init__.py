"""The engine: LLM and AsyncLLM, its configuration, the scheduler and page bookkeeping (plain CPU, no
torch), the two records between scheduler and runner, the model runner and its CUDA graphs, and
output processing. Its names are imported lazily (through moetier's own), so importing
`moetier.engine.scheduler` stays free of torch."""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "AsyncLLM", "EngineConfig", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        import moetier

        return getattr(moetier, name)
    raise AttributeError(f"module 'moetier.engine' has no attribute {name!r}")
