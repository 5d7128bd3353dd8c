"""`quant eval`: accuracy evals and A/B reports."""
from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

import typer

from fitllm.cli.common import console, fail

TASKS_HELP = ("Comma-separated: wikitext,hellaswag,arc_easy,arc_challenge,piqa,lambada (or 'all'); "
              "TASK=FILE reads that task from FILE. Default: wikitext, or only --text when given.")


def eval_command(
    models: Optional[List[str]] = typer.Argument(
        None, help="BASE then CANDIDATE... Each: a model folder, .gguf or hub id, 'embedded', "
                   "or PATH@kv=fp8, PATH@quant=nf4 (or int4, fp8: quantized as it loads), or both "
                   "(PATH@quant=nf4,kv=fp8); PATH omitted or 'base': the base's weights. Omitted: the embedded model."),
    tasks: Optional[str] = typer.Option(None, "--tasks", help=TASKS_HELP),
    text: Optional[Path] = typer.Option(None, "--text", help="Perplexity on any UTF-8 plain-text file."),
    limit: Optional[int] = typer.Option(None, "--limit", help="First N windows / questions / prompts per task."),
    kv_dtype: str = typer.Option("auto", "--kv-dtype", help="KV cache dtype for candidates: auto | fp8 | int8 | int4 (also bf16, fp16, fp32)"),
    ctx: int = typer.Option(512, "--ctx", help="Perplexity window length in tokens."),
    stride: Optional[int] = typer.Option(None, "--stride", help="Sliding-window stride (default: ctx, no overlap)."),
    data_dir: Optional[List[Path]] = typer.Option(
        None, "--data-dir", help="Folder with local data files (repeatable; also $FITLLM_DATA_DIR). "
                                 "See fitllm/evals/data.py for the file names and formats."),
    kl_tokens: int = typer.Option(4096, "--kl-tokens", help="Tokens with full-distribution KL (base keeps N x vocab floats)."),
    kv_calib: Optional[Path] = typer.Option(
        None, "--kv-calib", help="Text file for fp8/int4 KV-cache statistics (default: text the model samples itself)."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="Prompts for generation agreement, one per line."),
    gen_tokens: int = typer.Option(32, "--gen-tokens", help="New tokens per prompt for generation agreement."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu | cuda (default: cuda when present)."),
    output: Path = typer.Option(Path("reports"), "-o", "--output", help="Report folder."),
) -> None:
    """Evaluate BASE and CANDIDATE models; write report.md, report.json and report.html."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from fitllm.evals import EvalError, EvalSettings, parse_spec, run_ab, write_report
    from fitllm.evals.data import ALL_TASKS, DataError
    from fitllm.models.errors import FitLLMError

    try:
        settings = EvalSettings(limit=limit, ctx=ctx, stride=stride, text=text, kl_tokens=kl_tokens,
                                gen_tokens=gen_tokens, kv_calib=kv_calib)
        settings.tasks, settings.task_files = _parse_tasks(tasks, text is not None, ALL_TASKS)
        dirs = list(data_dir or [])
        if os.environ.get("FITLLM_DATA_DIR"):
            dirs += [Path(p) for p in os.environ["FITLLM_DATA_DIR"].split(os.pathsep)]
        settings.data_dirs = dirs
        if device:
            settings.device = device
        if prompts:
            settings.prompts = [p for p in prompts.read_text().splitlines() if p.strip()]
        if limit is not None and limit < 1:
            raise EvalError("--limit must be at least 1")
        models = list(models or [])
        base = parse_spec(models[0] if models else None)
        candidates = [parse_spec(m, base, default_kv=kv_dtype) for m in models[1:]]
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=False) as progress:
            report = run_ab(base, candidates, settings, progress)
        paths = write_report(report, output)
    except (FitLLMError, DataError, OSError, ValueError) as exc:
        fail(str(exc))
    console.print(paths["md"].read_text(), highlight=False, markup=False)
    console.print(f"wrote {paths['md']}, {paths['json'].name}, {paths['html'].name}", highlight=False)


def _parse_tasks(tasks: Optional[str], have_text: bool, known) -> tuple[list[str], dict[str, Path]]:
    if tasks is None:
        return ([] if have_text else ["wikitext"]), {}
    names, files = [], {}
    for item in filter(None, (t.strip() for t in tasks.split(","))):
        name, _, path = item.partition("=")
        if name == "all":
            names += [t for t in known if t not in names]
            continue
        names.append(name)
        if path:
            files[name] = Path(path)
    return names, files


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_command)
