"""moetier: serve Mixture-of-Experts models larger than GPU memory.

    from moetier import LLM, SamplingParams
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_EXPORTS = {"LLM": "moetier.engine.llm", "AsyncLLM": "moetier.engine.async_llm",
            "EngineConfig": "moetier.engine.config", "RequestOutput": "moetier.engine.output",
            "CompletionOutput": "moetier.engine.output", "SamplingParams": "moetier.sampling_params",
            "ExpertOptions": "moetier.experts.placement"}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    # Lazy: `import moetier` (the CLI's --help, the scheduler's tests) does not pull in torch.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'moetier' has no attribute {name!r}")
