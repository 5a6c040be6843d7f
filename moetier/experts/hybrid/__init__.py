"""The `hybrid` backend: the slot cache whose misses are filled over the link or computed by the host
cores. backend.py is the layer, cost_model.py the per-step choice, nodes.py and device_plan.py the
capturable CUDA-default mode, host_kernels.py / host_ext.py / csrc/ the host cores' kernels,
host_path.py the shared host worker, phases.py its optional timing."""
