"""`quant bench`: an online load generator (any OpenAI-compatible server) and offline throughput."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from fitllm.cli.common import MODEL_HELP, fail

bench_app = typer.Typer(help="Benchmarks: `serve` (online, any OpenAI server) and `offline` (engine, no HTTP).",
                        no_args_is_help=True)
out = Console()


def _print_summary(title: str, summary: dict) -> None:
    table = Table(title=title)
    table.add_column("metric")
    for col in ("mean", "p50", "p90", "p99"):
        table.add_column(col, justify="right")
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        if key in summary:
            table.add_row(key, *(f"{summary[key][c]:.1f}" for c in ("mean", "p50", "p90", "p99")))
    out.print(table)
    for key in ("completed", "errors", "duration_s", "request_throughput", "output_tokens_per_s", "total_tokens_per_s"):
        if key in summary:
            value = summary[key]
            out.print(f"{key:>22}: {value:.2f}" if isinstance(value, float) else f"{key:>22}: {value}")
    for example in summary.get("error_examples", []):
        out.print(f"[red]error example:[/] {example}")


def _save(summary: dict, path: Optional[Path]) -> None:
    if path:
        path.write_text(json.dumps(summary, indent=2))
        out.print(f"wrote {path}")


@bench_app.command("serve")
def bench_serve(
    url: str = typer.Option("http://127.0.0.1:8000", "--url", help="Base URL of an OpenAI-compatible server."),
    model: Optional[str] = typer.Option(None, "--model", help="Model name to send (default: the server's first in /v1/models)."),
    rate: float = typer.Option(float("inf"), "--rate", help="Requests per second (Poisson arrivals); inf = all at once."),
    num_prompts: int = typer.Option(100, "--num-prompts"),
    input_len: int = typer.Option(128, "--input-len", help="Prompt tokens (median for --dist sharegpt)."),
    output_len: int = typer.Option(128, "--output-len", help="Output tokens (median for --dist sharegpt)."),
    dist: str = typer.Option("fixed", "--dist", help="fixed | sharegpt (lognormal lengths, long tail)."),
    vocab_size: int = typer.Option(32000, "--vocab-size", help="Token ids are drawn below this."),
    max_concurrency: Optional[int] = typer.Option(None, "--max-concurrency"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="FITLLM_API_KEY"),
    seed: int = typer.Option(0, "--seed"),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write the summary as JSON here."),
) -> None:
    """Load an OpenAI-compatible server and report TTFT, inter-token and end-to-end latency p50/p90/p99."""
    from fitllm.serve.bench import make_workload, run_online

    try:
        workload = make_workload(num_prompts, input_len, output_len, dist, vocab_size, seed=seed)
    except ValueError as exc:
        fail(str(exc))
    with Progress(console=Console(stderr=True)) as progress:
        task = progress.add_task("requests", total=num_prompts)
        summary = asyncio.run(run_online(url, workload, rate, model, api_key, max_concurrency,
                                         on_done=lambda: progress.advance(task), seed=seed))
    summary |= {"num_prompts": num_prompts, "input_len": input_len, "output_len": output_len, "dist": dist}
    _print_summary(f"online: {url} at {rate} req/s", summary)
    _save(summary, json_path)
    if summary["completed"] == 0:
        raise typer.Exit(1)


@bench_app.command("offline")
def bench_offline(
    model: Optional[str] = typer.Argument(None, help=MODEL_HELP),
    num_prompts: int = typer.Option(100, "--num-prompts"),
    input_len: int = typer.Option(128, "--input-len"),
    output_len: int = typer.Option(128, "--output-len"),
    dist: str = typer.Option("fixed", "--dist", help="fixed | sharegpt"),
    kv_dtype: str = typer.Option("auto", "--kv-dtype"),
    kv_layout: str = typer.Option("auto", "--kv-layout", help="auto | split | shared (as quant serve)"),
    max_num_seqs: int = typer.Option(256, "--max-num-seqs"),
    max_num_batched_tokens: int = typer.Option(8192, "--max-num-batched-tokens"),
    quantization: Optional[str] = typer.Option(None, "--quantization",
                                               help="nf4 | int4 | fp8: quantize a dense MODEL as it loads "
                                                    "(as quant serve --quantization)."),
    json_path: Optional[Path] = typer.Option(None, "--json"),
) -> None:
    """Throughput of the engine itself (no HTTP): all prompts at once, greedy, EOS ignored."""
    from fitllm.models.errors import FitLLMError
    from fitllm.serve.bench import make_workload, run_offline
    from fitllm.serve.engine import EngineConfig, LLMEngine

    try:
        engine = LLMEngine(EngineConfig(model=model, kv_dtype=kv_dtype, kv_layout=kv_layout, max_num_seqs=max_num_seqs,
                                        max_num_batched_tokens=max_num_batched_tokens, quantization=quantization))
        workload = make_workload(num_prompts, input_len, output_len, dist,
                                 engine.model_config.vocab_size, max_len=engine.max_model_len)
    except (FitLLMError, ValueError) as exc:
        fail(str(exc))
    summary = run_offline(engine, workload) | {"input_len": input_len, "output_len": output_len, "dist": dist}
    _print_summary(f"offline: {model or 'embedded model'}" + (f", {quantization} at load" if quantization else ""),
                   summary)
    _save(summary, json_path)


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
