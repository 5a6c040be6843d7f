"""The Triton expert GEMMs: grouped GEMM for decode steps (grouped_gemm.py) and large steps
(grouped_gemm_large.py), the GEMVs of one-token steps on FP8 and 4-bit rows (fp8_gemv.py,
q4_gemv.py), their block sizes
(gemm_config.py, importable without Triton) and the clamped SwiGLU they share (swiglu_clamp.py)."""
