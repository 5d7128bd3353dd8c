"""Write an A/B report three ways: report.md (GitHub tables), report.json (the data as computed),
report.html (one self-contained page: inline CSS and SVG, no scripts, no network)."""
from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Optional

PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f"]


def write_report(report: dict, out_dir: Path) -> dict[str, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"md": out_dir / "report.md", "json": out_dir / "report.json", "html": out_dir / "report.html"}
    paths["json"].write_text(json.dumps(report, indent=2) + "\n")
    paths["md"].write_text(to_markdown(report))
    paths["html"].write_text(to_html(report))
    return paths


# ---- formatting helpers ----------------------------------------------------------------------

def _value(metric: str, v: Optional[float]) -> str:
    if v is None:
        return "—"
    return f"{v:.3f}" if metric == "ppl" else f"{100 * v:.2f}"


def _diff(metric: str, d: Optional[dict], higher_is_better: bool) -> str:
    if not d:
        return ""
    scale, fmt = (1, "{:+.3f}") if metric == "ppl" else (100, "{:+.2f}")
    text = fmt.format(scale * d["diff"])
    if d["lo"] is not None:
        text += f" [{fmt.format(scale * d['lo'])}, {fmt.format(scale * d['hi'])}]"
        # A CI that excludes 0 on the bad side is a real loss at this sample size: flag it.
        worse = d["hi"] < 0 if higher_is_better else d["lo"] > 0
        better = d["lo"] > 0 if higher_is_better else d["hi"] < 0
        text += " ▼" if worse else (" ▲" if better else "")
    return text


def _ci(c: dict, scale: float = 1.0, digits: int = 4) -> str:
    text = f"{scale * c['value']:.{digits}f}"
    if c.get("lo") is not None:
        text += f" [{scale * c['lo']:.{digits}f}, {scale * c['hi']:.{digits}f}]"
    return text


def _bytes(n: Optional[int]) -> str:
    if n is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _table(header: list[str], rows: list[list[str]], align: Optional[list[str]] = None) -> str:
    align = align or ["---"] + ["---:"] * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


# ---- markdown --------------------------------------------------------------------------------

def to_markdown(r: dict) -> str:
    base, cands = r["base"], r["candidates"]
    s = r["settings"]
    out = [f"# fitllm eval: {base}" + (f" vs {', '.join(cands)}" if cands else "") + "\n",
           f"ctx {s['ctx']}, stride {s['stride']}, limit {s['limit'] or 'none'}, device {s['device']}; "
           f"{s['ci_level']:.0%} paired bootstrap CIs ({s['bootstrap_resamples']} resamples) on every "
           "difference. Accuracies in %. ▼/▲: the CI excludes 0 on the worse/better side.\n"]
    header = ["task", "metric", "n", base] + [f"{c} (Δ [CI])" for c in cands]
    rows = []
    for m in r["metrics"]:
        row = [m["task"], m["metric"] + (" ↓" if not m["higher_is_better"] else " ↑"), str(m["n"]),
               _value(m["metric"], m["values"][base])]
        for c in cands:
            row.append(f"{_value(m['metric'], m['values'].get(c))} ({_diff(m['metric'], m['diffs'].get(c), m['higher_is_better'])})")
        rows.append(row)
    out.append("## Quality\n\n" + _table(header, rows, ["---", "---", "---:"] + ["---:"] * (1 + len(cands))))
    if r["distribution"] or r["generation"]:
        rows = []
        for d in r["distribution"]:
            rows.append([d["candidate"], d["task"], _ci(d["kl"]), _ci(d["top1"], 100, 2), str(d["kl_tokens"])])
        out.append("## Distribution vs base\n\nMean KL(base ‖ candidate) of next-token distributions (nats) on the "
                   "first tokens of the perplexity windows; top-1 agreement (%) on all scored tokens.\n\n"
                   + _table(["candidate", "text", "KL", "top-1 agree %", "KL tokens"], rows, ["---", "---", "---:", "---:", "---:"]))
        if r["generation"]:
            rows = [[g["candidate"], _ci(g["prefix_agreement"], 100, 1), _ci(g["exact_match"], 100, 1), str(g["prompts"])]
                    for g in r["generation"]]
            out.append(f"Greedy generation ({r['settings']['gen_tokens']} new tokens): share of tokens before the first "
                       "divergence from the base, and share of identical outputs (%).\n\n"
                       + _table(["candidate", "prefix agree %", "identical %", "prompts"], rows))
    rows = []
    for m in r["models"]:
        speed = m.get("speed") or {}
        rows.append([m["name"], m["method"], m["kv_dtype"], _bytes(m["disk_bytes"]), _bytes(m["weight_bytes"]),
                     _bytes(m["kv_bytes_per_token"]),
                     str(speed.get("prefill_tokens_per_s", "—")), str(speed.get("decode_tokens_per_s_batch1", "—")),
                     str(speed.get("decode_tokens_per_s_batch16", "—")),
                     str(next(iter((m.get("ppl_tokens_per_second") or {}).values()), "—")), f"{m['eval_seconds']:.1f}"])
    out.append("## Cost\n\n" + _table(
        ["model", "weights", "KV", "disk", "weight memory", "KV bytes/token", "prefill tok/s", "decode tok/s (b=1)",
         "decode tok/s (b=16)", "ppl tok/s", "eval s"], rows, ["---", "---", "---"] + ["---:"] * 8))
    out.append("prefill/decode: eager-mode GPU measurements (only when a GPU is present); ppl tok/s: tokens read "
               "per second by the perplexity pass on this run's device; eval s: wall time of all tasks.\n")
    out.append(f"\nTotal time {r['elapsed_seconds']:.0f} s, {r['created']}.\n")
    return "\n".join(out)


# ---- HTML + SVG ------------------------------------------------------------------------------

def _svg_bars(title: str, groups: list[str], series: list[tuple[str, list[Optional[dict]]]], unit: str,
              zero_line: bool = True) -> str:
    """Grouped bars with optional CI whiskers. series: (name, per group {"v","lo","hi"} or None)."""
    width, height, left, bottom, top = 640, 260, 60, 50, 30
    values = [x for _, pts in series for p in pts if p for x in (p["v"], p.get("lo"), p.get("hi")) if x is not None]
    if not values:
        return ""
    lo, hi = min(values + [0.0]), max(values + [0.0])
    if hi == lo:
        hi = lo + 1
    pad = (hi - lo) * 0.08
    lo, hi = lo - (pad if lo < 0 else 0), hi + pad
    plot_h = height - top - bottom
    y = lambda v: top + (hi - v) / (hi - lo) * plot_h
    gw = (width - left - 10) / max(len(groups), 1)
    bw = gw * 0.8 / max(len(series), 1)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img">',
             f'<text x="{width / 2}" y="18" text-anchor="middle" font-weight="bold">{html.escape(title)}</text>']
    for k in range(5):  # y grid and labels
        v = lo + (hi - lo) * k / 4
        parts.append(f'<line x1="{left}" x2="{width - 10}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#eee"/>'
                     f'<text x="{left - 4}" y="{y(v) + 4:.1f}" text-anchor="end" font-size="10">{v:.3g}</text>')
    if zero_line:
        parts.append(f'<line x1="{left}" x2="{width - 10}" y1="{y(0):.1f}" y2="{y(0):.1f}" stroke="#666"/>')
    parts.append(f'<text x="12" y="{top + plot_h / 2}" font-size="10" transform="rotate(-90 12 {top + plot_h / 2})" '
                 f'text-anchor="middle">{html.escape(unit)}</text>')
    for g, group in enumerate(groups):
        gx = left + g * gw + gw * 0.1
        parts.append(f'<text x="{gx + gw * 0.4:.1f}" y="{height - bottom + 14}" text-anchor="middle" font-size="10">'
                     f'{html.escape(group)}</text>')
        for s, (name, pts) in enumerate(series):
            p = pts[g]
            if not p:
                continue
            x = gx + s * bw
            y0, y1 = sorted((y(0), y(p["v"])))
            color = PALETTE[s % len(PALETTE)]
            parts.append(f'<rect x="{x:.1f}" y="{y0:.1f}" width="{bw * 0.9:.1f}" height="{max(y1 - y0, 0.5):.1f}" '
                         f'fill="{color}"><title>{html.escape(name)}: {p["v"]:.4g}</title></rect>')
            if p.get("lo") is not None:
                cx = x + bw * 0.45
                parts.append(f'<line x1="{cx:.1f}" x2="{cx:.1f}" y1="{y(p["lo"]):.1f}" y2="{y(p["hi"]):.1f}" stroke="#000"/>'
                             f'<line x1="{cx - 3:.1f}" x2="{cx + 3:.1f}" y1="{y(p["lo"]):.1f}" y2="{y(p["lo"]):.1f}" stroke="#000"/>'
                             f'<line x1="{cx - 3:.1f}" x2="{cx + 3:.1f}" y1="{y(p["hi"]):.1f}" y2="{y(p["hi"]):.1f}" stroke="#000"/>')
    for s, (name, _) in enumerate(series):  # legend
        lx = left + s * 150
        parts.append(f'<rect x="{lx}" y="{height - 18}" width="10" height="10" fill="{PALETTE[s % len(PALETTE)]}"/>'
                     f'<text x="{lx + 14}" y="{height - 9}" font-size="10">{html.escape(name[:22])}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _md_table_to_html(md: str) -> str:
    """The markdown report's tables and paragraphs as HTML (one source of truth for the numbers)."""
    out, rows = [], []
    def flush():
        if rows:
            head, body = rows[0], rows[2:]
            out.append("<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in head) + "</tr>"
                       + "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in body)
                       + "</table>")
            rows.clear()
    for line in md.splitlines():
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
            continue
        flush()
        if line.startswith("## "):
            out.append(f"<h2>{html.escape(line[3:])}</h2>")
        elif line.startswith("# "):
            out.append(f"<h1>{html.escape(line[2:])}</h1>")
        elif line.strip():
            out.append(f"<p>{html.escape(line)}</p>")
    flush()
    return "\n".join(out)


def to_html(r: dict) -> str:
    cands = r["candidates"]
    plots = []
    if cands:
        for metric in ("ppl", "acc", "acc_norm"):
            rows = [m for m in r["metrics"] if m["metric"] == metric]
            if not rows:
                continue
            scale = 1 if metric == "ppl" else 100
            series = []
            for c in cands:
                pts = []
                for m in rows:
                    d = m["diffs"].get(c)
                    pts.append(None if not d else {"v": scale * d["diff"],
                                                   "lo": None if d["lo"] is None else scale * d["lo"],
                                                   "hi": None if d["hi"] is None else scale * d["hi"]})
                series.append((c, pts))
            unit = "Δ perplexity (lower is better)" if metric == "ppl" else f"Δ {metric} (points)"
            plots.append(_svg_bars(f"{metric}: candidate − base, with 95% CI", [m["task"] for m in rows], series, unit))
        for task in sorted({d["task"] for d in r["distribution"]}):
            dist = [d for d in r["distribution"] if d["task"] == task]
            buckets = list(dict.fromkeys(b for d in dist for b in d["kl_by_position"]))
            series = [(d["candidate"], [{"v": d["kl_by_position"][b]} if b in d["kl_by_position"] else None
                                        for b in buckets]) for d in dist]
            plots.append(_svg_bars(f"{task}: mean KL(base ‖ candidate) by context length (tokens)", buckets, series,
                                   "KL (nats)"))
    style = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}"
             "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;"
             "text-align:right;font-size:13px}td:first-child,th:first-child{text-align:left}"
             "svg{margin:1em 1em 0 0;font-family:system-ui,sans-serif}")
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>fitllm eval</title>"
            f"<style>{style}</style></head><body>\n{_md_table_to_html(to_markdown(r))}\n"
            + ("<h2>Plots</h2>\n" + "\n".join(p for p in plots if p) if plots else "")
            + "\n</body></html>\n")
