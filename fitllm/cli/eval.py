"""`quant eval`: accuracy evals and A/B reports."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from fitllm.cli.common import not_built


def eval_command(
    models: Optional[List[str]] = typer.Argument(None, help="BASE then CANDIDATE... (omitted: the embedded model)."),
    tasks: str = typer.Option("wikitext", "--tasks", help="wikitext,hellaswag,arc_easy,arc_challenge,piqa,lambada"),
    text: Optional[Path] = typer.Option(None, "--text", help="Perplexity on any plain-text file."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Examples (or windows) per task."),
    kv_dtype: str = typer.Option("auto", "--kv-dtype", help="auto | fp8 | int8 | int4"),
    output: Path = typer.Option(Path("reports"), "-o", "--output", help="Report folder."),
) -> None:
    """Evaluate BASE and CANDIDATE models; write report.md, report.json and report.html."""
    not_built("eval")


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_command)
