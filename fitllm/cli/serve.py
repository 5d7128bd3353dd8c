"""`quant serve`: the OpenAI-compatible server."""
from __future__ import annotations

from typing import Optional

import typer

from fitllm.cli.common import MODEL_HELP, not_built


def serve(
    model: Optional[str] = typer.Argument(None, help=MODEL_HELP),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
    kv_dtype: str = typer.Option("auto", "--kv-dtype", help="auto | bf16 | fp16 | fp8 | int8 | int4"),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len"),
    max_num_seqs: int = typer.Option(64, "--max-num-seqs"),
    gpu_memory_utilization: float = typer.Option(0.9, "--gpu-memory-utilization"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="FITLLM_API_KEY"),
) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API."""
    not_built("serve")


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
