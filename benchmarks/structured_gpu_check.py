"""GPU check of structured output (JSON mode, JSON schemas, forced tool calls) in the engine: the
masks on the device, the sampler's `allowed` rows, CUDA graphs and look-ahead around them.

    python benchmarks/structured_gpu_check.py TOKENIZER_DIR [--device cuda]

TOKENIZER_DIR: the embedded model's tokenizer files (the GGUF itself is too large to carry), e.g.
a copy of ~/.cache/fitllm/gguf-SmolLM2-*/ without model.safetensors. The model has SmolLM2-135M's
shapes and random weights (bf16): what it writes means nothing, but every structured answer must
still be a prefix of a value of its schema, a finished one a whole value, and the plain requests
of the batch must come out exactly as they do in a batch without the structured ones.
Then the cost: decode tokens/s of 16 plain requests alone, and beside one JSON-mode request (the
next step's forward is still queued ahead; its sampling waits for the host's mask), and the number
of look-ahead steps.
Exit status 1 if a check fails.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_engine_check import random_model  # noqa: E402

from fitllm.models.tokenizer import load_tokenizer  # noqa: E402
from fitllm.serve import json_mode  # noqa: E402
from fitllm.serve.engine import EngineConfig, LLMEngine  # noqa: E402
from fitllm.serve.sampling import SamplingParams  # noqa: E402

PERSON = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad", "calm"]},
                                           "n": {"enum": [1, 2, 3]}, "ok": {"type": "boolean"}},
          "required": ["mood", "n"]}
TOOLS = {"type": "array", "minItems": 1, "maxItems": 2, "items": {"anyOf": [
    {"type": "object", "properties": {"name": {"const": "get_weather"},
                                      "parameters": {"type": "object", "properties": {
                                          "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"]}},
     "required": ["name", "parameters"]},
    {"type": "object", "properties": {"name": {"const": "get_time"}, "parameters": {"type": "object",
                                                                                    "additionalProperties": False}},
     "required": ["name", "parameters"]}]}}
RULES = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                                          "day": {"type": "string", "format": "date"},
                                          "p": {"type": "number", "minimum": 0, "maximum": 1},
                                          "name": {"type": "string", "minLength": 2, "maxLength": 8}},
         "required": ["code", "day", "p", "name"]}


def follows_rules(value: dict) -> bool:
    """RULES checked by Python itself (re, datetime, comparisons), not by the automaton."""
    return (re.fullmatch("[A-Z]{2}-[0-9]{3}", value["code"]) is not None and bool(date.fromisoformat(value["day"]))
            and 0 <= value["p"] <= 1 and 2 <= len(value["name"]) <= 8)


def engine(model, tokenizer, device: str, graphs: bool = True) -> LLMEngine:
    cfg = EngineConfig(device=device, max_model_len=1024, max_num_seqs=32, cuda_graphs=graphs and device != "cpu",
                       gpu_memory_utilization=0.5)
    return LLMEngine(cfg, model=model, tokenizer=tokenizer)


def check_outputs(eng: LLMEngine, prompts, length: int) -> bool:
    plain = [SamplingParams(max_tokens=length // 3, temperature=0.0) for _ in range(6)]
    structured = ([SamplingParams(max_tokens=length, temperature=1.0, seed=s, json_object=True) for s in range(6)]
                  + [SamplingParams(max_tokens=length, temperature=1.0, seed=s, json_schema=PERSON) for s in range(6)]
                  + [SamplingParams(max_tokens=length, temperature=0.7, seed=s, json_schema=TOOLS) for s in range(6)]
                  + [SamplingParams(max_tokens=length, temperature=0.7, seed=s, json_schema=RULES) for s in range(6)])
    alone = eng.generate(prompts[:6], plain)
    mixed = eng.generate(prompts[:6] + prompts[6:30], plain + structured)
    ok = [a.new_token_ids for a in alone] == [m.new_token_ids for m in mixed[:6]]
    print(f"  plain greedy requests unchanged beside 24 structured ones: {'PASS' if ok else 'FAIL'}")
    finished = 0
    for params, out in zip(structured, mixed[6:]):
        schema = json_mode.schema_for(params.json_schema)
        config = schema.walk(schema.start, out.new_text.encode())
        good = config is not None
        if out.finish_reason == "stop":
            finished += 1
            try:
                value = json.loads(out.new_text)
                good = good and (params.json_schema is not RULES or follows_rules(value))
            except (ValueError, KeyError, TypeError):
                good = False
            good = good and schema.done(config)
        if not good:
            print(f"  FAIL: {out.finish_reason} {out.new_text[:200]!r}")
        ok = ok and good
    print(f"  24 structured answers valid prefixes, the {finished} finished ones whole values: "
          f"{'PASS' if ok else 'FAIL'}; e.g. {mixed[12].new_text[:80]!r}, {mixed[18].new_text[:100]!r}, "
          f"{mixed[24].new_text[:100]!r}")
    return ok


def decode_rate(eng: LLMEngine, prompts, with_json: bool, length: int) -> float:
    params = [SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True) for _ in range(16)]
    if with_json:  # (a document of enums that never closes within the budget would stop early: any object)
        prompts, params = prompts + [prompts[0]], params + [SamplingParams(max_tokens=length, temperature=1.0, seed=1,
                                                                           json_object=True)]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"{'json' if sp.json_object else 'plain'}-{i}-{time.perf_counter_ns()}", p, sp)
    steps, t0, tokens = 0, None, 0
    while eng.has_unfinished_requests():
        outs = eng.step()
        steps += 1
        if steps == 2:
            t0, tokens = time.perf_counter(), 0
        elif t0 is not None:
            tokens += sum(len(o.new_token_ids) for o in outs if o.request_id.startswith("plain"))
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    return tokens / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tokenizer", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=160, help="structured answers' max_tokens (16 on a CPU dry run)")
    args = ap.parse_args()
    tokenizer = load_tokenizer(args.tokenizer)
    dtype = torch.bfloat16 if args.device != "cpu" else torch.float32
    model = random_model("smollm2-135m", args.device, dtype)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (int(n),), generator=g).tolist() for n in torch.randint(8, 64, (30,), generator=g)]
    t = time.perf_counter()
    eng = engine(model, tokenizer, args.device)
    print(f"engine up in {time.perf_counter() - t:.1f} s (graphs {eng.cuda_graphs}, JSON vocabulary read in warm-up)")
    t = time.perf_counter()
    ok = check_outputs(eng, prompts, args.tokens)
    grammar = eng.json_grammar()
    print(f"  checks took {time.perf_counter() - t:.1f} s; {len(grammar.cache)} masks cached")
    rates = {}
    for with_json in (False, True, False, True):
        rates.setdefault(with_json, []).append(decode_rate(eng, prompts[:16], with_json, args.tokens))
    print("decode tokens/s of 16 greedy requests (best of 2): alone %.0f, beside one JSON-mode request %.0f "
          "(look-ahead steps so far: %d)" % (max(rates[False]), max(rates[True]), eng.num_look_ahead_steps))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
