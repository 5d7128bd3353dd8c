"""fitllm: quantization-first LLM serving for constrained GPUs."""

__version__ = "0.1.0"
