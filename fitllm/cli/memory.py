"""`quant memory`: what fits on a card. Thin: parse, call fitllm.budget, print."""
from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from fitllm import budget as bm
from fitllm.cli.common import fail, weights_label
from fitllm.models.errors import FitLLMError

out = Console(highlight=False)


def _size(n: float) -> str:
    return f"{n / bm.GiB:.2f} GiB" if abs(n) >= bm.GiB else f"{n / bm.MiB:.0f} MiB"


def _local_gpu() -> tuple[Optional[bm.Gpu], int, Optional[str]]:
    """The card this process sees, if any: (catalog entry for its bandwidth, memory in bytes, arch)."""
    import torch

    if not torch.cuda.is_available():
        return None, 0, None
    props = torch.cuda.get_device_properties(0)
    try:
        gpu = bm.find_gpu(props.name)
    except FitLLMError:
        gpu = None
    return gpu, props.total_memory, f"sm{props.major}{props.minor}"


def memory(
    model: Optional[str] = typer.Argument(
        None, help="HF folder, .gguf, config.json, a known name (e.g. llama-3-8b) or a hub id. "
        "Omitted: the embedded SmolLM2-135M."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="A GPU from the catalog, e.g. rtx4090, l4, h200."),
    gpu_mem: Optional[float] = typer.Option(None, "--gpu-mem", help="GPU memory in GiB (a card not in the catalog)."),
    quant: Optional[str] = typer.Option(None, "--quant", help="bf16 | awq | gptq | fp8 | nf4 "
                                        "(default: the checkpoint's own scheme)"),
    lm_head: bool = typer.Option(False, "--quantize-lm-head",
                                 help="With --quant gptq: plan a checkpoint whose lm_head is quantized too "
                                      "(quant convert --format gptq --quantize-lm-head)."),
    lm_head_bits: int = typer.Option(8, "--lm-head-bits", help="With --quantize-lm-head: 8 or 4."),
    bits: Optional[int] = typer.Option(None, "--bits", help="With --quant gptq: the layers' weight bits, 4 or 8 "
                                       "(default: the checkpoint's own, else 4)."),
    kv_dtype: str = typer.Option("auto", "--kv-dtype", help="auto | bf16 | fp16 | fp8 | int8 | int4"),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="(default: the model's limit)"),
    max_num_seqs: int = typer.Option(bm.DEFAULT_MAX_NUM_SEQS, "--max-num-seqs"),
    max_batched_tokens: int = typer.Option(bm.DEFAULT_MAX_BATCHED_TOKENS, "--max-num-batched-tokens",
                                           help="Token budget of one step (as `quant serve`)."),
    no_cuda_graphs: bool = typer.Option(False, "--no-cuda-graphs"),
    block_size: Optional[int] = typer.Option(None, "--block-size", help="Tokens per KV block "
                                             "(default: 64 with --kv-dtype fp8 or int8, else 16; as `quant serve`)"),
    utilization: float = typer.Option(bm.DEFAULT_GPU_MEMORY_UTILIZATION, "--gpu-memory-utilization"),
    kv_layout: str = typer.Option("auto", "--kv-layout", help="auto | split | shared: sliding-window layers' KV "
                                  "in blocks of their own that keep only the window (the rest of the memory "
                                  "goes to the other layers), or kept whole beside the others (as `quant serve`)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object (bytes) instead of tables."),
) -> None:
    """Memory budget: weights, KV cache, workspace; how many sequences fit at what context."""
    try:
        config, label = bm.load_config(model)
        checkpoint_scheme = bm.detect_scheme(config)
        scheme = quant or checkpoint_scheme
        # an already-quantized checkpoint says its group size (-1: per channel)
        group = bm.checkpoint_group_size(config) if scheme == checkpoint_scheme else None
        if scheme not in bm.SCHEMES:
            raise FitLLMError(f"unknown --quant {scheme!r}; choose one of {', '.join(bm.SCHEMES)}")
        bits = _weight_bits(bits, scheme, checkpoint_scheme, config)
        if lm_head and bm.lm_head_bits(config) is None:
            if scheme != "gptq":
                raise FitLLMError("--quantize-lm-head: only GPTQ checkpoints carry a quantized lm_head; add --quant gptq")
            if checkpoint_scheme not in ("bf16", "fp16"):
                raise FitLLMError(f"--quantize-lm-head: {label} is already quantized with a bf16 lm_head; "
                                  "plan its original model instead")
            config = bm.with_quantized_lm_head(config, lm_head_bits)
        settings = bm.Settings(scheme=scheme, kv_dtype=bm.normalize_kv_dtype(kv_dtype),
                               max_model_len=config.max_position_embeddings if max_model_len is None else max_model_len,
                               max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens,
                               block_size=block_size, gpu_memory_utilization=utilization,
                               cuda_graphs=not no_cuda_graphs, group_size=group, bits=bits, kv_layout=kv_layout)
        if gpu is not None and gpu_mem is not None:
            raise FitLLMError("give --gpu or --gpu-mem, not both")
        if gpu_mem is not None and not gpu_mem > 0:
            raise FitLLMError(f"--gpu-mem {gpu_mem:g}: give the card's memory in GiB (more than 0)")
        card, mem, arch = (bm.find_gpu(gpu), 0, None) if gpu else (None, int(gpu_mem * bm.GiB), None) if gpu_mem \
            else _local_gpu()
        mem = mem or (card.memory_bytes if card else 0)
        settings = replace(settings, gpu_arch=arch or (card.arch if card else None))
    except FitLLMError as exc:
        fail(str(exc))
    if not mem:
        return _catalog(config, label, settings, json_out)
    command_model = _command_model(model)
    p = bm.plan(config, settings, mem, card, command_model, checkpoint_scheme)
    needs_convert = scheme != checkpoint_scheme
    if json_out:
        doc = {"model": label, "gpu": asdict(card) if card else {"memory_gib": mem / bm.GiB},
               **p.budget.as_dict(), "command": p.command, "needs_convert": needs_convert,
               "decode_tokens_per_s": p.tokens_per_s() if p.budget.fits else {}, "alternatives": p.alternatives}
        if not p.budget.fits and not p.alternatives:
            doc["cards_that_fit"] = [g.key for g in bm.cards_that_fit(config, _smallest(settings))]
        print(json.dumps(doc, indent=2))
        return
    _print_plan(p, config, label, mem, needs_convert, command_model, lm_head)
    if command_model != model:
        out.print(f"({model} is a shape the planner knows, not a checkpoint: put its folder or hub id where the "
                  "commands say MODEL_DIR.)")


def _command_model(model: Optional[str]) -> Optional[str]:
    """MODEL as the suggested commands should name it: a known short name (llama-3-8b) is no path that
    `quant convert` or `quant serve` can open, so they get the placeholder MODEL_DIR instead."""
    if model is None or "/" in model or Path(model).expanduser().exists() or bm.known_model(model) is None:
        return model
    return "MODEL_DIR"


def _weight_bits(bits: Optional[int], scheme: str, checkpoint_scheme: str, config) -> int:
    """--bits checked against the scheme; by default the checkpoint's own bits, else 4."""
    if bits is None:
        return bm.checkpoint_bits(config) if scheme == checkpoint_scheme and scheme in ("awq", "gptq") else 4
    if bits not in (4, 8):
        raise FitLLMError(f"--bits: {bits} is not supported (4 or 8)")
    if bits != 4 and scheme != "gptq":
        raise FitLLMError(f"--bits {bits}: only GPTQ weights come in 8 bits; add --quant gptq")
    return bits


def _smallest(s: bm.Settings) -> bm.Settings:
    kv = "int4" if s.kv_dtype != "fp8" else "fp8"
    return bm.Settings(**{**asdict(s), "scheme": "awq", "bits": 4, "kv_dtype": kv})


def _scheme_name(s: bm.Settings, config) -> str:
    if (config.quantization_config or {}).get("quant_method") == "bitsandbytes" and s.scheme == bm.detect_scheme(config):
        return weights_label(config)  # its 8-bit rows are counted as fitllm's int8 layout ("gptq 8-bit")
    return f"{s.scheme} {s.bits}-bit" if s.scheme in ("awq", "gptq") else s.scheme


def _print_convert(s: bm.Settings, config, model: Optional[str], lm_head: bool) -> None:
    head = f" --format gptq --quantize-lm-head --lm-head-bits {bm.lm_head_bits(config)}" if lm_head else ""
    bits = f" --bits {s.bits}" if s.bits != 4 else ""
    out.print(f"First convert: quant convert {model or ''} --method {s.scheme}{bits}{head} -o CONVERTED_DIR")


def _print_plan(p: bm.Plan, config, label: str, mem: int, needs_convert: bool, model: Optional[str],
                lm_head: bool = False) -> None:
    b, s, card = p.budget, p.budget.settings, p.gpu
    where = f"{card.name} ({card.memory_gib:g} GiB, {card.bandwidth_gbs:g} GB/s{', FP8' if card.fp8 else ''})" \
        if card else f"a {mem / bm.GiB:g} GiB card"
    out.print(f"[bold]{label}[/] · weights {_scheme_name(s, config)} · KV {s.kv_dtype} · block {s.block_size} · on {where}")
    table = Table(show_edge=False)
    table.add_column("term")
    table.add_column("size", justify="right")
    table.add_column("what it is")
    for name, value in {**b.terms, "kv_cache": b.kv_cache}.items():
        what = bm.TERM_HELP[name]
        if name == "weights":
            w = b.weights
            what += f" (linears {_size(w.linears)}, embeddings {_size(w.embeddings)}, " + \
                (f"lm_head {_size(w.lm_head)})" if w.lm_head else "lm_head tied)")
        if name == "kv_cache" and b.split:
            what += (f" ({b.num_kv_blocks} pages x {s.block_size} tokens x {b.page_bytes_per_token} B, shared by the "
                     f"full-attention and the sliding-window layers' blocks: {b.page_widths[0]} and "
                     f"{b.page_widths[1]} pages a block)")
        elif name == "kv_cache":
            what += f" ({b.num_kv_blocks} x {s.block_size} tokens x {b.kv_bytes_per_token} B)"
        table.add_row(name, _size(value), what)
    table.add_row("[bold]total[/]", f"[bold]{_size(b.total)}[/]",
                  f"of {_size(b.usable)} usable ({s.gpu_memory_utilization:g} x {_size(mem)})")
    out.print(table)
    if card is not None and not card.fp8 and "fp8" in (s.scheme, s.kv_dtype):
        out.print(f"[yellow]note:[/] {card.name} has no FP8 tensor cores: fp8 weights run as W8A16; "
                  "for the KV cache prefer int8.")
    if b.fits:
        out.print(f"[green]Fits:[/] {b.max_seqs_at(s.max_model_len)} sequences at {s.max_model_len} tokens; "
                  f"at {s.max_num_seqs} sequences, up to {b.longest_context_at(s.max_num_seqs)} tokens each.")
        speed = p.tokens_per_s()
        if speed:
            out.print(f"Decode (bandwidth roofline, an upper bound): ~{speed['single_seq_short_ctx']:.0f} tok/s for one "
                      f"sequence; ~{speed['batch_full_ctx']:.0f} tok/s total at {speed['batch_seqs']} x {s.max_model_len} tokens.")
        _print_layout(b, config)
        if needs_convert:
            _print_convert(s, config, model, lm_head)
        out.print(f"Run: [bold]{p.command}[/]")
        if needs_convert and s.scheme in ("nf4", "fp8") and config.quantization_config is None:  # data-free: no files
            at_load = p.command.replace("CONVERTED_DIR", model or "").replace("  ", " ")
            out.print(f"Or, without converting: {at_load} --quantization {s.scheme}")
        return
    one = bm.kv_cache_bytes(config, s.kv_dtype, s.max_model_len, s.block_size)
    if s.kv_layout != "shared" and bm.has_sliding_and_full_layers(config):
        one = b.kv_read_bytes(s.max_model_len)  # (a split cache keeps only the window of the sliding layers)
    short = "the model's limit is " + str(b.model_max_len) if s.max_model_len > b.model_max_len else \
        f"{_size(b.fixed)} before any KV cache, {_size(one)} for one sequence of {s.max_model_len} tokens"
    out.print(f"[red]Does not fit[/] in {_size(b.usable)}: {short}.")
    if p.alternatives:
        alt = Table("what would fit", "sequences", "command", show_edge=False)
        for a in p.alternatives:
            alt.add_row(a["change"], str(a["max_num_seqs"]), a["command"])
        out.print(alt)
        if needs_convert and any(a.get("scheme", s.scheme) == s.scheme for a in p.alternatives):
            _print_convert(s, config, model, lm_head)  # (rows of another scheme say how to convert in theirs)
    else:
        small = _smallest(s)
        cards = bm.cards_that_fit(config, small)
        out.print(f"Nothing fits on this card. With awq weights and {small.kv_dtype} KV it fits on: "
                  + (", ".join(g.key for g in cards) or "none of the catalog's cards"))


def _print_layout(b: bm.Budget, config) -> None:
    """How the sliding-window layers' KV is kept, where the model has some."""
    count, window = bm.sliding_layers(config)
    if b.window_only:
        out.print(f"Every layer slides over {window} tokens: a sequence keeps only its last window's blocks "
                  "(--kv-layout shared keeps all).")
    if not bm.has_sliding_and_full_layers(config):
        return
    s = b.settings
    if b.split:
        shared = bm.estimate(config, replace(s, kv_layout="shared"), b.gpu_memory)
        out.print(f"KV split: the {count} sliding-window layers keep only their last {window} tokens; the pages "
                  f"they give back hold the other {config.num_layers - count} layers' context: one sequence up to "
                  f"{b.kv_tokens:,} tokens (--kv-layout shared: {shared.kv_tokens:,}).")
    elif s.kv_layout == "auto":
        out.print(f"KV shared: the context ({s.max_model_len}) is no longer than the {count} sliding-window layers' "
                  f"window ({window}), so every layer keeps every token.")


def _catalog(config, label: str, s: bm.Settings, json_out: bool) -> None:
    """No card given and none here: the same plan across the catalog."""
    rows = []
    for g in bm.GPUS:
        b = bm.estimate(config, replace(s, gpu_arch=g.arch), g.memory_bytes)
        rows.append({"gpu": g.key, "memory_gib": g.memory_gib, "fits": b.fits,
                     "max_seqs_at_max_model_len": b.max_seqs_at(s.max_model_len),
                     "longest_context_one_seq": b.longest_context_at(1),
                     "decode_tok_s_one_seq": round(bm.decode_tokens_per_s(b, g.bandwidth_gbs, 1, 1024)) if b.fits else None})
    if json_out:
        print(json.dumps({"model": label, "settings": asdict(s), "gpus": rows}, indent=2))
        return
    out.print(f"[bold]{label}[/] · weights {_scheme_name(s, config)} · KV {s.kv_dtype} · {s.max_model_len} tokens "
              f"(no --gpu given and no GPU here: every card in the catalog)")
    table = Table("gpu", "GiB", f"seqs at {s.max_model_len}", "longest context, 1 seq", "tok/s, 1 seq", show_edge=False)
    for r in rows:
        color = "green" if r["fits"] else "red"
        table.add_row(r["gpu"], f"{r['memory_gib']:g}", f"[{color}]{r['max_seqs_at_max_model_len']}[/]",
                      str(r["longest_context_one_seq"]), str(r["decode_tok_s_one_seq"] or "-"))
    out.print(table)


def register(app: typer.Typer) -> None:
    app.command("memory")(memory)
