"""Several processes, one model: tensor and expert parallelism over torch.distributed (docs/parallel.md).

    group.py     process-group setup: rendezvous, backend (gloo on CPU, nccl on CUDA), timeouts
    worker.py    a worker rank: loads its share of the model, runs every step rank 0 broadcasts
    executor.py  rank 0's side: spawns the workers, broadcasts each StepInput, notices dead workers

The per-rank layout the model and the expert placement are built with is moetier/parallel.Parallel
(a plain record below the models, so models and experts can take it without importing this package).
"""

from moetier.parallel import Parallel

__all__ = ["Parallel"]
