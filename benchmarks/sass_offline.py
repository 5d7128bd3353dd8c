"""Compile a fitllm Triton kernel for a GPU this machine does not have (default sm_90) and report
what the code does: registers, spills, shared memory, and an instruction histogram of the SASS
(whole kernel and the hottest loop). Costs no device time; used to iterate on codegen before timing.

    python benchmarks/sass_offline.py KERNEL 'arg=type,...' 'CONST=value,...' [--warps 4 --stages 3]
        [--dump DIR]   # writes ttgir / ptx / sass there

KERNEL is module:function (e.g. fitllm.kernels.w4a16:_w4a16_tc_kernel). Types are Triton signature
strings: *bf16, *i32, *fp32, i32, fp32 ... ; arguments not named are taken as i32 (pointers must be
named). Constexprs not named keep their defaults (an error names the missing ones).
"""
from __future__ import annotations

import argparse
import collections
import importlib
import inspect
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def parse_kv(s: str) -> dict:
    out = {}
    for part in filter(None, (p.strip() for p in s.split(","))):
        k, v = part.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def const_value(v: str):
    if v in ("True", "False"):
        return v == "True"
    try:
        return int(v, 0)
    except ValueError:
        try:
            return float(v)
        except ValueError:
            import triton.language as tl
            return getattr(tl, v) if hasattr(tl, v) else v


def compile_kernel(kernel, types: dict, consts: dict, arch: int = 90, warps: int = 4, stages: int = 3,
                   maxnreg: int | None = None):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel.fn if hasattr(kernel, "fn") else kernel
    sig_params = inspect.signature(fn).parameters
    params = list(sig_params)
    sig, cvals = {}, {}
    for p in params:
        param = sig_params[p]
        if p in consts:
            sig[p] = "constexpr"
            cvals[p] = consts[p]
        elif "constexpr" in str(param.annotation) and param.default is not inspect.Parameter.empty:
            sig[p] = "constexpr"  # a constexpr not named keeps its default (not a runtime i32)
            cvals[p] = param.default
        else:
            sig[p] = types.get(p, "i32")
    # launches specialise integer and pointer arguments that are multiples of 16; assume they are
    # (name an argument in `types` as "i32:1" to opt out)
    attrs = {}
    for i, p in enumerate(params):
        t = sig[p]
        if t == "constexpr":
            continue
        if t.endswith(":1"):
            sig[p] = t[:-2]
        elif t.startswith("*") or t.startswith("i"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    if getattr(kernel, "is_gluon", lambda: False)():  # Gluon kernels need Gluon's source (layouts, num-warps)
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    src = ASTSource(kernel, signature=sig, constexprs=cvals, attrs=attrs)
    opts = {"num_warps": warps, "num_stages": stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


def sass_of(cubin: bytes) -> str:
    import triton

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm, "-c", "-g", f.name], capture_output=True, text=True, check=True).stdout


INSTR = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)")


def opcodes(lines) -> list:
    """The opcode (without modifiers) of each instruction line, in order."""
    return [m.group(2).split(".")[0] for m in map(INSTR.match, lines) if m]


def histogram(lines) -> collections.Counter:
    return collections.Counter(opcodes(lines))


def hottest_loop(sass: str):
    """Instructions of the largest backward-branch region (the main loop, for these kernels)."""
    lines = sass.splitlines()
    addr = {}
    for i, ln in enumerate(lines):
        m = re.match(r"^\s*/\*([0-9a-f]+)\*/", ln)
        if m:
            addr[int(m.group(1), 16)] = i
    labels = {}
    for i, ln in enumerate(lines):
        m = re.match(r"^\.(L_x_\d+):", ln)
        if m:
            labels[m.group(1)] = i
    best = (0, 0, 0)
    for i, ln in enumerate(lines):
        m = re.search(r"\bBRA\b.*`\(\.(L_x_\d+)\)", ln)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            start = labels[m.group(1)]
            size = sum(1 for l in lines[start:i + 1] if INSTR.match(l))
            if size > best[0]:
                best = (size, start, i + 1)
    return lines[best[1]:best[2]]


def resource_usage(cubin: bytes) -> dict:
    """Registers and spill bytes per thread, from cuobjdump --dump-resource-usage."""
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", text)
    stack = re.search(r"STACK:(\d+)", text)
    return {"regs": int(regs.group(1)) if regs else None, "stack": int(stack.group(1)) if stack else None}


def report(compiled, dump: str | None = None) -> dict:
    sass = sass_of(compiled.asm["cubin"])
    md = compiled.metadata
    use = resource_usage(compiled.asm["cubin"])
    out = {"shared": md.shared, "regs": use["regs"], "spills": use["stack"]}
    loop = hottest_loop(sass)
    out["loop_ops"] = opcodes(loop)  # in issue order
    out["loop_instr"] = len(out["loop_ops"])
    out["loop_hist"] = collections.Counter(out["loop_ops"]).most_common(24)
    out["all_hist"] = histogram(sass.splitlines()).most_common(16)
    if dump:
        os.makedirs(dump, exist_ok=True)
        for k in ("ttgir", "ptx"):
            open(os.path.join(dump, f"kernel.{k}"), "w").write(compiled.asm[k])
        open(os.path.join(dump, "kernel.sass"), "w").write(sass)
        open(os.path.join(dump, "loop.sass"), "w").write("\n".join(loop))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel")
    ap.add_argument("types", nargs="?", default="")
    ap.add_argument("consts", nargs="?", default="")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--maxnreg", type=int, default=None, help="register cap per thread (ptxas .maxnreg)")
    ap.add_argument("--dump", default=None)
    ap.add_argument("--json", action="store_true", help="print the report as one JSON line")
    a = ap.parse_args()
    mod, name = a.kernel.split(":")
    kernel = getattr(importlib.import_module(mod), name)
    consts = {k: const_value(v) for k, v in parse_kv(a.consts).items()}
    c = compile_kernel(kernel, parse_kv(a.types), consts, a.arch, a.warps, a.stages, a.maxnreg)
    r = report(c, a.dump)
    if a.json:
        import json

        print(json.dumps({k: dict(v) if k.endswith("hist") else v for k, v in r.items()}))
        return
    print(f"regs {r['regs']}  stack {r['spills']} B  shared {r['shared']} B  main-loop instructions {r['loop_instr']}")
    print("loop:", ", ".join(f"{k} {v}" for k, v in r["loop_hist"]))
    print("all: ", ", ".join(f"{k} {v}" for k, v in r["all_hist"]))


if __name__ == "__main__":
    main()
