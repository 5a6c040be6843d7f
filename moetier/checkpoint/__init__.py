"""Checkpoints: safetensors shard headers, validation against a model's tensor list, the generic
loader, and the streaming writer of random-weight checkpoints."""
