"""Helpers shared by the CLI commands: model argument, error reporting."""
from __future__ import annotations

import sys
from typing import NoReturn

import typer
from rich.console import Console

console = Console(stderr=True)

MODEL_HELP = (
    "A local Hugging Face folder, a .gguf file, or a hub id (needs network). "
    "Omitted: the embedded SmolLM2-135M-Instruct."
)


def fail(message: str, code: int = 1) -> NoReturn:
    """Print one clear error line and exit: users get a sentence, not a traceback."""
    console.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


def not_built(command: str) -> NoReturn:
    """A subcommand whose implementation has not landed yet says so plainly."""
    console.print(f"[bold yellow]quant {command}[/] is not built yet in this version of fitllm.")
    sys.exit(2)


def weights_label(config) -> str:
    """What the linears are: the checkpoint's quantization method, or what --quantization made of them."""
    if config.quantized_at_load:
        return f"{config.quantized_at_load} (quantized at load)"
    qc = config.quantization_config or {}
    method = str(qc.get("quant_method") or qc.get("format") or "dense")
    if method == "bitsandbytes":
        from fitllm.quant.formats.bitsandbytes import bits_of

        return "bitsandbytes " + (str(qc.get("bnb_4bit_quant_type", "fp4")) if bits_of(qc) == 4 else "int8")
    return method
