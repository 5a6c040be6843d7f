"""The Triton expert GEMMs: grouped GEMM for decode steps (grouped_gemm.py) and large steps
(grouped_gemm_large.py), the FP8 GEMV for one-token steps (fp8_gemv.py), their block sizes
(gemm_config.py, importable without Triton) and the clamped SwiGLU they share (swiglu_clamp.py)."""
