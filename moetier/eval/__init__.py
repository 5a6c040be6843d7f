"""`moetier eval`: lm-eval's tasks against an OpenAI-compatible server (ours, spawned, or any URL),
offline, and the accuracy gate that runs one task set over several engine configurations
(docs/eval.md). lm-eval is an optional extra (`pip install 'moetier[eval]'`): nothing here imports
it before a run needs it."""
