"""`quant bench`: load generator and offline throughput."""
from __future__ import annotations

import typer

from fitllm.cli.common import not_built

bench_app = typer.Typer(help="Benchmarks: `serve` (online, any OpenAI server) and `offline` (engine).")


@bench_app.command("serve")
def bench_serve() -> None:
    """Online load against an OpenAI-compatible server."""
    not_built("bench serve")


@bench_app.command("offline")
def bench_offline() -> None:
    """Offline engine throughput, no HTTP."""
    not_built("bench offline")


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
