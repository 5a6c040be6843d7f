"""The OpenAI-compatible HTTP server: request records and their checks (protocol.py), the reasoning
and tool-call parsers (reasoning.py, tools.py), Prometheus metrics (metrics.py), the completion and
chat handlers (handlers.py), the fastapi app and its routes (app.py) and `moetier serve`'s start-up
(run.py). Imports fastapi lazily from moetier's own modules: the engine never needs it."""
