"""`quant convert`: quantize a checkpoint to AWQ, GPTQ, FP8 or RTN."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from fitllm.cli.common import MODEL_HELP, not_built


def convert(
    model: Optional[str] = typer.Argument(None, help=MODEL_HELP),
    method: str = typer.Option(..., "--method", help="rtn | awq | gptq | fp8"),
    bits: int = typer.Option(4, "--bits", help="Weight bits for rtn/awq/gptq: 4 or 8."),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="Input channels per scale; -1 = per channel."),
    format: str = typer.Option("compressed-tensors", "--format", help="compressed-tensors | autoawq | gptq"),
    calib: Optional[Path] = typer.Option(None, "--calib", help="Calibration text: .txt or .jsonl."),
    output: Path = typer.Option(..., "-o", "--output", help="Output folder (written atomically)."),
) -> None:
    """Quantize MODEL layer by layer and write a checkpoint fitllm, vLLM and transformers load."""
    not_built("convert")


def register(app: typer.Typer) -> None:
    app.command("convert")(convert)
