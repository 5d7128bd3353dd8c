"""`quant memory`: what fits on a card."""
from __future__ import annotations

from typing import Optional

import typer

from fitllm.cli.common import not_built


def memory(
    model: Optional[str] = typer.Argument(None, help="Model folder, .gguf, or a folder with config.json."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="A GPU name from the catalog, e.g. rtx4090, h200."),
    gpu_mem: Optional[float] = typer.Option(None, "--gpu-mem", help="GPU memory in GiB."),
    quant: str = typer.Option("bf16", "--quant", help="bf16 | awq | gptq | fp8 | nf4"),
    kv_dtype: str = typer.Option("auto", "--kv-dtype"),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len"),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Memory budget: weights, KV cache, workspace; how many sequences fit at what context."""
    not_built("memory")


def register(app: typer.Typer) -> None:
    app.command("memory")(memory)
