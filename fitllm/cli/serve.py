"""`quant serve`: the OpenAI-compatible server."""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Optional

import typer

from fitllm.cli.common import MODEL_HELP, console, fail, weights_label

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def serve(
    model: Optional[str] = typer.Argument(None, help=MODEL_HELP),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; 0.0.0.0 exposes the server."),
    port: int = typer.Option(8000, "--port"),
    kv_dtype: str = typer.Option("auto", "--kv-dtype", help="auto | bf16 | fp16 | fp8 | int8 | int4"),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="Context length (prompt + output)."),
    max_num_seqs: int = typer.Option(64, "--max-num-seqs", help="Requests run at once."),
    gpu_memory_utilization: float = typer.Option(0.9, "--gpu-memory-utilization",
                                                 help="Share of GPU memory fitllm may use."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="FITLLM_API_KEY",
                                          help="Require 'Authorization: Bearer KEY' on every route but /health."),
    device: str = typer.Option("auto", "--device", help="auto | cuda | cuda:N | cpu"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Compute dtype (default: bf16 on GPU, fp32 on CPU)."),
    max_num_batched_tokens: int = typer.Option(2048, "--max-num-batched-tokens",
                                               help="Token budget of one step (prefill chunk size)."),
    num_kv_blocks: Optional[int] = typer.Option(None, "--num-kv-blocks", help="Fix the KV pool size: blocks (a split "
                                                "cache, see --kv-layout: pages)."),
    block_size: Optional[int] = typer.Option(None, "--block-size", help="Tokens per KV block (default: 64 with "
                                             "--kv-dtype fp8 or int8, whose attention then reads whole cache lines; "
                                             "else 16)."),
    max_waiting: int = typer.Option(256, "--max-waiting", help="Queued requests before answering 429."),
    request_timeout: float = typer.Option(600.0, "--request-timeout", help="Seconds a request may take."),
    max_request_bytes: int = typer.Option(4 << 20, "--max-request-bytes", help="Largest request body."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name",
                                                    help="Model name in the API (default: from MODEL)."),
    chat_template: Optional[str] = typer.Option(None, "--chat-template",
                                                help="A Jinja chat template for /v1/chat/completions, in place of "
                                                     "the tokenizer's (a base model has none): a file, or the "
                                                     "template itself."),
    tool_call_parser: Optional[str] = typer.Option(
        None, "--tool-call-parser",
        help="How tool_choice 'auto' finds calls in the model's text: hermes (<tool_call> blocks: Qwen2.5/3, Hermes), "
             "llama3_json (Llama 3.1-3.3's {\"name\", \"parameters\"} replies), mistral ([TOOL_CALLS] lists or "
             "name[ARGS]{...} calls: Mistral-7B-v0.3, Nemo, Small, Magistral) or none (then 'auto' is a 400; "
             "'required' and named functions always work). Default: hermes where the chat template mentions "
             "<tool_call>, mistral where it mentions [TOOL_CALLS], llama3_json where it speaks as Llama 3's, "
             "else none."),
    no_prefix_caching: bool = typer.Option(False, "--no-prefix-caching"),
    kv_layout: str = typer.Option(
        "auto", "--kv-layout",
        help="Models with sliding-window layers (Gemma 3: five of six see the last 1,024 tokens): split gives those "
             "layers KV blocks of their own that go back to the pool behind each sequence's window, so the full "
             "layers' context gets the memory (several times the tokens); shared keeps every token of every layer "
             "(a cached prefix stays whole longer); auto splits where the context is longer than the window. "
             "`quant memory --kv-layout` shows both."),
    no_cuda_graphs: bool = typer.Option(False, "--no-cuda-graphs"),
    speculative: Optional[str] = typer.Option(None, "--speculative",
                                              help="Speculative decoding drafter: ngram | self-int4 | PATH of a "
                                                   "draft model sharing the tokenizer."),
    num_speculative_tokens: int = typer.Option(4, "--num-speculative-tokens", help="Draft tokens per step (k)."),
    quantization: Optional[str] = typer.Option(
        None, "--quantization", help="Quantize a dense checkpoint as it loads, no calibration: nf4 (bitsandbytes' "
        "NF4, blocks of 64; half int4's batch-1 decode speed), int4 (RTN asym, group 128 where it divides) or fp8 "
        "(W8A8, per-channel). For a calibrated AWQ/GPTQ model, `quant convert` first."),
    deterministic: bool = typer.Option(
        False, "--deterministic",
        help="Sum split-K GEMM partials in a fixed order (FITLLM_DETERMINISTIC=1): the same request mix gives the "
             "same bits, and the same greedy tokens, every run. Default: atomic adds, whose order varies on a GPU."),
    log_level: str = typer.Option("info", "--log-level", help="critical | error | warning | info | debug"),
) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API."""
    _check_options(port, max_num_seqs, gpu_memory_utilization, max_waiting, request_timeout, max_request_bytes)
    if deterministic:  # read by every split-K launch, so set before the CUDA graphs are captured
        os.environ["FITLLM_DETERMINISTIC"] = "1"
    if speculative and not 1 <= num_speculative_tokens <= 16:
        fail(f"--num-speculative-tokens {num_speculative_tokens}: must be between 1 and 16 with --speculative")
    template = _read_chat_template(chat_template) if chat_template is not None else None
    if tool_call_parser not in (None, "hermes", "llama3_json", "mistral", "none"):
        fail(f"--tool-call-parser {tool_call_parser}: expected hermes, llama3_json, mistral or none")
    _check_port_free(host, port)
    engine = _build_engine(model, device, dtype, kv_dtype, max_model_len, max_num_seqs, max_num_batched_tokens,
                           num_kv_blocks, gpu_memory_utilization, not no_prefix_caching, not no_cuda_graphs,
                           speculative, num_speculative_tokens, block_size, quantization, kv_layout)
    from fitllm.serve.app import ServerConfig, create_app

    name = served_model_name or _default_name(model)
    config = ServerConfig(served_model_name=name, model_aliases=tuple(a for a in (model,) if a),
                          api_key=api_key, max_body_bytes=max_request_bytes, max_waiting=max_waiting,
                          request_timeout=request_timeout, chat_template=template, tool_call_parser=tool_call_parser)
    _print_summary(engine, name, host, port, api_key)
    _run(create_app(engine, config), host, port, log_level, request_timeout)


def _check_options(port, max_num_seqs, gpu_mem, max_waiting, timeout, max_bytes) -> None:
    if not 0 < port < 65536:
        fail(f"--port {port}: must be between 1 and 65535")
    if max_num_seqs < 1 or max_waiting < 1:
        fail("--max-num-seqs and --max-waiting must be at least 1")
    if not 0 < gpu_mem <= 1:
        fail(f"--gpu-memory-utilization {gpu_mem}: must be in (0, 1]")
    if timeout <= 0 or max_bytes < 1024:
        fail("--request-timeout must be positive and --max-request-bytes at least 1024")


def _read_chat_template(value: str) -> str:
    """The template's text: the file `value` names, or `value` itself where it holds template syntax
    (as vLLM reads it). Compiled the way transformers renders it (a sandbox with loop controls and
    its `generation` tag), before the minutes of model loading."""
    import jinja2

    path = Path(value).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        if not any(c in value for c in "{}\n"):
            fail(f"--chat-template {value}: cannot read it ({exc})")
        text, path = value, "(the template given inline)"
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # another transformers: its own rendering will report a broken template
        return text
    try:
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as exc:
        fail(f"--chat-template {path}: line {exc.lineno}: {exc.message}")
    return text


def _check_port_free(host: str, port: int) -> None:
    """Fail before the minutes of model loading, not after."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            fail(f"cannot listen on {host}:{port} ({exc.strerror or exc})")


def _build_engine(model, device, dtype, kv_dtype, max_model_len, max_num_seqs, max_num_batched_tokens,
                  num_kv_blocks, gpu_memory_utilization, prefix_caching, cuda_graphs, speculative=None,
                  num_speculative_tokens=4, block_size=None, quantization=None, kv_layout="auto"):
    from fitllm.models.errors import FitLLMError
    from fitllm.serve.engine import EngineConfig, LLMEngine

    try:  # the config checks its numbers (e.g. --block-size 0) before any loading
        config = EngineConfig(model=model, device=device, dtype=dtype, kv_dtype=kv_dtype,
                              max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens, num_kv_blocks=num_kv_blocks,
                              gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=prefix_caching,
                              cuda_graphs=cuda_graphs,
                              speculative=(speculative if speculative in (None, "ngram", "self-int4")
                                           else f"draft-model:{speculative}"),
                              num_speculative_tokens=num_speculative_tokens, block_size=block_size,
                              quantization=quantization, kv_layout=kv_layout)
        console.print(f"loading {model or 'the embedded SmolLM2-135M-Instruct'}"
                      + (f", quantizing it to {quantization} as it loads" if quantization else "") + " ...",
                      highlight=False)
        return LLMEngine(config)
    except (FitLLMError, ValueError, OSError) as exc:
        fail(str(exc))
    except RuntimeError as exc:  # e.g. CUDA out of memory while sizing the KV cache
        fail(f"the engine could not start: {exc}")


def _default_name(model: Optional[str]) -> str:
    if model is None:
        from fitllm.models.hub import EMBEDDED_NAME
        return EMBEDDED_NAME
    path = Path(model).expanduser()
    return path.stem if path.suffix == ".gguf" else (path.name if path.exists() else model)


def _print_summary(engine, name: str, host: str, port: int, api_key: Optional[str]) -> None:
    stats = engine.stats()
    cfg = engine.config
    blocks = stats.get("kv_blocks_total")
    tokens = f"{blocks * cfg.block_size:,} tokens" if blocks is not None else "? tokens"
    if stats.get("kv_split"):
        tokens = f"one sequence up to {stats['kv_split']['longest_sequence']:,} tokens"
    device = getattr(engine, "device", cfg.device)
    dtype = getattr(engine, "dtype", cfg.dtype)
    kv = getattr(engine, "kv_dtype", cfg.kv_dtype)
    console.print(f"model      {name}   weights {weights_label(engine.model_config)}\n"
                  f"device     {device}   dtype {dtype}   kv-dtype {kv}\n"
                  f"kv cache   {blocks} {'pages' if stats.get('kv_split') else 'blocks'} x {cfg.block_size} = {tokens}"
                  f"{_window_pool(engine, stats)}\n"
                  f"context    max_model_len {engine.max_model_len}   max_num_seqs {cfg.max_num_seqs}   "
                  f"step budget {cfg.max_num_batched_tokens} tokens", highlight=False)
    if host not in LOCAL_HOSTS and not api_key:
        console.print(f"[bold yellow]warning:[/] listening on {host} without --api-key: anyone who can reach "
                      "this port can use the model.", highlight=False)
    console.print(f"serving    http://{host}:{port}/v1  (auth {'on' if api_key else 'off'})", highlight=False)


def _window_pool(engine, stats: dict) -> str:
    """The summary's note on a split cache ("" without one)."""
    split = stats.get("kv_split")
    if split is None:
        return ""
    from fitllm.budget import sliding_layers

    count, window = sliding_layers(engine.model_config)
    full, sliding = split["page_widths"]
    return (f" (pages of {split['page_layers']} layers: a block of the full-attention layers takes {full}, one "
            f"of the {count} sliding-window layers {sliding}, given back behind the window of {window}; "
            f"--kv-layout split)")


def _run(app, host: str, port: int, log_level: str, request_timeout: float) -> None:
    import uvicorn

    # SIGTERM/SIGINT: uvicorn stops accepting, lets in-flight requests finish (up to the
    # request timeout), then the app's lifespan drains the engine.
    level = log_level.lower()
    uvicorn.run(app, host=host, port=port, log_level=level, access_log=level in ("info", "debug"),
                timeout_graceful_shutdown=int(request_timeout) + 5, timeout_keep_alive=5)


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
