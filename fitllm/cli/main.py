"""The `quant` command line: thin wrappers that parse, call into fitllm and print."""
from __future__ import annotations

import typer

from fitllm.cli import bench, convert, eval as eval_cmd, memory, serve

app = typer.Typer(
    name="quant",
    help="fitllm: quantize, evaluate, plan and serve LLMs on the GPU you have.\n\n"
    "With no MODEL every command uses the embedded default, SmolLM2-135M-Instruct.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
for module in (convert, eval_cmd, serve, memory, bench):
    module.register(app)


if __name__ == "__main__":
    app()
