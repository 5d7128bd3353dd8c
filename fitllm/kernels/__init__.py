# The modules that define Triton kernels (tests and benchmarks/compile_watch.py walk them).
TRITON_MODULES = ("fp8", "w4a16", "w4a16_tiled", "paged_attention", "_fused_triton")
