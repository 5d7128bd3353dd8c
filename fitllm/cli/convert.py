"""`quant convert`: quantize a checkpoint to AWQ, GPTQ, FP8, RTN or NF4."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from fitllm.cli.common import MODEL_HELP, console, fail


def convert(
    model: Optional[str] = typer.Argument(None, help=MODEL_HELP),
    method: str = typer.Option(..., "--method", help="rtn | awq | gptq | fp8 | nf4 (bitsandbytes' 4-bit NormalFloat, "
                                                      "data-free, the QLoRA baseline)"),
    bits: int = typer.Option(4, "--bits", help="Weight bits for rtn/awq/gptq: 4 or 8."),
    group_size: Optional[int] = typer.Option(None, "--group-size",
                                             help="Input channels per scale; -1 = per channel. "
                                                  "Default: 128, else 64, else 32 (whichever divides every input size); "
                                                  "nf4: weights per absmax, 64 (64..4096)."),
    format: Optional[str] = typer.Option(None, "--format", help="compressed-tensors | autoawq | gptq | bitsandbytes "
                                                                "(default: bitsandbytes for nf4, else compressed-tensors)"),
    calib: Optional[str] = typer.Option(None, "--calib",
                                        help="Calibration text: .txt or .jsonl ({'text': ...} per line), or "
                                             "hf:DATASET[:CONFIG[:SPLIT]]. Default: built-in text the model writes itself."),
    output: Path = typer.Option(..., "-o", "--output", help="Output folder (written atomically)."),
    sym: Optional[bool] = typer.Option(None, "--sym/--asym", help="Symmetric or asymmetric int grid (default asym)."),
    act_order: Optional[bool] = typer.Option(None, "--act-order/--no-act-order",
                                             help="GPTQ: quantize columns by decreasing activation energy (default on)."),
    static_groups: bool = typer.Option(False, "--static-groups",
                                       help="GPTQ act-order: keep groups by column index (no g_idx)."),
    fp8_static: bool = typer.Option(False, "--fp8-static", help="FP8: static per-tensor activation scales from calibration."),
    calib_samples: int = typer.Option(32, "--calib-samples", help="Calibration sequences."),
    calib_len: int = typer.Option(512, "--calib-len", help="Tokens per calibration sequence."),
    lm_head: bool = typer.Option(False, "--quantize-lm-head",
                                 help="Quantize the lm_head too, to --lm-head-bits (--format gptq only; GPTQ on "
                                      "--method gptq, else RTN): it is the largest matrix a decode step reads "
                                      "(Llama-3-8B: 1 GB of bf16) and the most sensitive one; the summary shows its "
                                      "logits error."),
    lm_head_bits: Optional[int] = typer.Option(None, "--lm-head-bits",
                                               help="With --quantize-lm-head: 8 (default) or 4. On the embedded "
                                                    "model 8 bits cost +0.14% perplexity, 4 bits +15.7%; Llama-3-8B "
                                                    "int4 batch-1 decode on an H200 gains 3.8% / 5.5%."),
    force: bool = typer.Option(False, "--force", help="Replace the -o folder if it exists (the old one is removed "
                                                     "only once the new one is complete)."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu | cuda[:N] (default: cuda when present)."),
) -> None:
    """Quantize MODEL layer by layer and write a checkpoint fitllm, vLLM and transformers load."""
    import torch

    from fitllm.models.errors import FitLLMError
    from fitllm.models.hub import resolve_model
    from fitllm.quant.pipeline import quantize_model

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if lm_head_bits is not None and not lm_head:
        fail("--lm-head-bits needs --quantize-lm-head")
    try:
        folder = resolve_model(model)
        result = quantize_model(folder, output, method, bits=bits, group_size=group_size, sym=sym, fmt=format,
                                calib=calib, calib_samples=calib_samples, calib_len=calib_len, act_order=act_order,
                                static_groups=static_groups, fp8_static=fp8_static, force=force, device=device,
                                lm_head_bits=(lm_head_bits or 8) if lm_head else None,
                                log=lambda s: console.print(s, highlight=False))
    except FitLLMError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        fail(f"interrupted: nothing was written to {output}", code=130)
    print_summary(result)


def print_summary(r) -> None:
    from rich.table import Table

    errs = r.layer_errors
    worst = max(range(len(errs)), key=errs.__getitem__) if errs else 0
    console.print(f"[bold green]wrote[/] {r.output} ({r.size_bytes / 2**20:.1f} MiB) in {r.seconds:.0f} s, "
                  f"peak memory {r.peak_memory / 2**30:.2f} GiB, calibration {r.calib_tokens} tokens", highlight=False)
    table = Table(title="per-layer relative output error (|y_q - y| / |y - x|)", show_lines=False)
    for col in ("layer", "error", "layer", "error", "layer", "error"):
        table.add_column(col, justify="right")
    third = (len(errs) + 2) // 3
    for i in range(third):
        cells = []
        for j in (i, i + third, i + 2 * third):
            cells += [str(j), f"{errs[j]:.4f}"] if j < len(errs) else ["", ""]
        table.add_row(*cells)
    console.print(table)
    if errs:
        console.print(f"mean {sum(errs) / len(errs):.4f}, worst layer {worst} ({errs[worst]:.4f})")
    if r.lm_head_error is not None:
        console.print(f"lm_head: relative logits error {r.lm_head_error:.4f} on calibration tokens")


def register(app: typer.Typer) -> None:
    app.command("convert")(convert)
