"""Eval data: local files in the formats below, or Hugging Face datasets when `datasets` is installed.

Every loader returns plain Python objects, so the scoring code never sees a file format:
perplexity tasks -> one string; multiple choice -> `MCExample`s; LAMBADA -> `(context, target)`.

Local formats (the file names are what `--data-dir` looks for, in DIR or DIR/<task folder>):

| task | file | format |
|---|---|---|
| wikitext | `wiki.test.raw` | WikiText-2 raw test split, read as one string, unchanged |
| `--text FILE` | any | UTF-8 plain text, read as one string, unchanged |
| hellaswag | `hellaswag_val_full.txt` | llama.cpp text: 6 lines per item: context, gold (0-3), 4 endings |
| hellaswag | `hellaswag_val.jsonl` | the official jsonl: activity_label, ctx_a, ctx_b, endings, label |
| arc_easy / arc_challenge | `arc_{easy,challenge}_test.llmfoundry.jsonl` | {"query": "Question: ...", "choices": [...], "gold": i} |
| arc_easy / arc_challenge | `ARC-{Easy,Challenge}-Test.jsonl` | the AI2 release: question.stem, question.choices[].text/label, answerKey |
| piqa | `valid.jsonl` + `valid-labels.lst` | {"goal", "sol1", "sol2"} per line; labels file: 0 or 1 per line |
| lambada | `lambada_test.jsonl` | OpenAI's LAMBADA: {"text": ...}; the target is the last space-separated word |

Prompts follow lm-evaluation-harness (so numbers are comparable with what it reports):
ARC and PIQA as "Question: ...\\nAnswer:" with " " + choice; HellaSwag through its `preprocess`.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

PPL_TASKS = ("wikitext",)
MC_TASKS = ("hellaswag", "arc_easy", "arc_challenge", "piqa")
ALL_TASKS = PPL_TASKS + MC_TASKS + ("lambada",)


class DataError(Exception):
    """A data file is missing or malformed; the message names the file and what was expected."""


@dataclass
class MCExample:
    context: str
    choices: list[str]  # continuations without the leading delimiter (lm-eval's doc_to_choice)
    gold: int
    delimiter: str = " "


# Where each task's files live (relative to a --data-dir), in order of preference.
LOCAL_FILES = {
    "wikitext": ["wiki.test.raw", "wikitext-2/wiki.test.raw", "wikitext-2-raw/wiki.test.raw"],
    "hellaswag": ["hellaswag_val_full.txt", "hellaswag/hellaswag_val_full.txt",
                  "hellaswag_val.jsonl", "hellaswag/hellaswag_val.jsonl"],
    "arc_easy": ["arc_easy_test.llmfoundry.jsonl", "arc/arc_easy_test.llmfoundry.jsonl",
                 "ARC-Easy-Test.jsonl", "arc/ARC-Easy-Test.jsonl"],
    "arc_challenge": ["arc_challenge_test.llmfoundry.jsonl", "arc/arc_challenge_test.llmfoundry.jsonl",
                      "ARC-Challenge-Test.jsonl", "arc/ARC-Challenge-Test.jsonl"],
    "piqa": ["valid.jsonl", "piqa/valid.jsonl"],
    "lambada": ["lambada_test.jsonl", "lambada/lambada_test.jsonl"],
}

# Hugging Face fallbacks: (dataset, config, split).
HF_DATASETS = {
    "wikitext": ("wikitext", "wikitext-2-raw-v1", "test"),
    "hellaswag": ("Rowan/hellaswag", None, "validation"),
    "arc_easy": ("allenai/ai2_arc", "ARC-Easy", "test"),
    "arc_challenge": ("allenai/ai2_arc", "ARC-Challenge", "test"),
    "piqa": ("ybisk/piqa", None, "validation"),
    "lambada": ("EleutherAI/lambada_openai", "default", "test"),
}


def find_task_file(task: str, data_dirs: Sequence[Path]) -> Optional[Path]:
    for d in data_dirs:
        for rel in LOCAL_FILES[task]:
            if (Path(d) / rel).is_file():
                return Path(d) / rel
    return None


def load_task(task: str, data_dirs: Sequence[Path] = (), path: Optional[Path] = None):
    """Data for `task`: from `path` if given, else the first match in `data_dirs`, else the hub."""
    if task not in ALL_TASKS:
        raise DataError(f"unknown task {task!r} (known: {', '.join(ALL_TASKS)})")
    path = path or find_task_file(task, data_dirs)
    if path is not None:
        return LOADERS[task](Path(path))
    return _load_from_hub(task, data_dirs)


# ---- plain text -----------------------------------------------------------------------------

def load_text(path: Path) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read as UTF-8 text ({exc})") from None
    if not text.strip():
        raise DataError(f"{path}: the file is empty")
    return text


# ---- multiple choice ------------------------------------------------------------------------

def _jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}:{n}: not valid JSON ({exc})") from None
    return rows


def hellaswag_preprocess(text: str) -> str:
    """lm-eval's HellaSwag cleanup: WikiHow '[title]' markers become sentence breaks."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def load_hellaswag(path: Path) -> list[MCExample]:
    if path.suffix == ".jsonl":
        return [MCExample(hellaswag_preprocess(r["activity_label"] + ": " + r["ctx_a"] + " " + r["ctx_b"].capitalize()),
                          [hellaswag_preprocess(e) for e in r["endings"]], int(r["label"]))
                for r in _jsonl(path)]
    lines = path.read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) % 6:
        raise DataError(f"{path}: {len(lines)} lines; the llama.cpp HellaSwag format has 6 per item")
    out = []
    for i in range(0, len(lines), 6):
        ctx, gold, *endings = lines[i:i + 6]
        if not gold.strip().isdigit():
            raise DataError(f"{path}:{i + 2}: expected the gold label (0-3), got {gold[:40]!r}")
        out.append(MCExample(hellaswag_preprocess(ctx), [hellaswag_preprocess(e) for e in endings], int(gold)))
    return out


def load_arc(path: Path) -> list[MCExample]:
    out = []
    for n, r in enumerate(_jsonl(path), 1):
        if "query" in r:  # llm-foundry: the query already reads "Question: <stem>"
            out.append(MCExample(r["query"] + "\nAnswer:", list(r["choices"]), int(r["gold"])))
        elif "question" in r:  # AI2 release (and the HF dataset, after _hf_row)
            q = r["question"]
            labels = [c["label"] for c in q["choices"]]
            if r["answerKey"] not in labels:
                raise DataError(f"{path}:{n}: answerKey {r['answerKey']!r} is not one of {labels}")
            out.append(MCExample(f"Question: {q['stem']}\nAnswer:", [c["text"] for c in q["choices"]],
                                 labels.index(r["answerKey"])))
        else:
            raise DataError(f"{path}:{n}: expected llm-foundry {{query, choices, gold}} or AI2 {{question, answerKey}}")
    return out


def load_piqa(path: Path, labels_path: Optional[Path] = None) -> list[MCExample]:
    rows = _jsonl(path)
    labels_path = labels_path or path.with_name(path.stem + "-labels.lst")
    if all("label" in r for r in rows):
        labels = [int(r["label"]) for r in rows]
    elif labels_path.exists():
        labels = [int(x) for x in labels_path.read_text().split()]
    else:
        raise DataError(f"{path}: PIQA labels not found: expected {labels_path.name} beside it (one 0/1 per line)")
    if len(labels) != len(rows):
        raise DataError(f"{labels_path}: {len(labels)} labels for {len(rows)} questions")
    return [MCExample(f"Question: {r['goal']}\nAnswer:", [r["sol1"], r["sol2"]], y) for r, y in zip(rows, labels)]


def load_lambada(path: Path) -> list[tuple[str, str]]:
    """(context, target) with target = " " + last word, as lm-eval's lambada_openai splits it."""
    out = []
    for r in _jsonl(path):
        context, _, word = r["text"].rpartition(" ")
        out.append((context, " " + word))
    return out


LOADERS = {
    "wikitext": load_text,
    "hellaswag": load_hellaswag,
    "arc_easy": load_arc,
    "arc_challenge": load_arc,
    "piqa": load_piqa,
    "lambada": load_lambada,
}


# ---- Hugging Face datasets (network) ---------------------------------------------------------

def _load_from_hub(task: str, data_dirs: Sequence[Path]):
    name, config, split = HF_DATASETS[task]
    where = ", ".join(str(d) for d in data_dirs) or "no --data-dir given"
    hint = f"put {LOCAL_FILES[task][0]} in a --data-dir ({where})"
    try:
        import datasets
    except ImportError:
        raise DataError(f"{task}: no local data file found; {hint}, or `pip install datasets` to fetch {name}") from None
    try:
        rows = list(datasets.load_dataset(name, config, split=split))
    except Exception as exc:  # offline, renamed dataset, script-based dataset no longer supported...
        raise DataError(f"{task}: {name} could not be loaded ({exc.__class__.__name__}: {exc}); {hint}") from None
    if task == "wikitext":
        return "".join(r["text"] for r in rows)
    if task == "hellaswag":
        return [MCExample(hellaswag_preprocess(r["activity_label"] + ": " + r["ctx_a"] + " " + r["ctx_b"].capitalize()),
                          [hellaswag_preprocess(e) for e in r["endings"]], int(r["label"])) for r in rows]
    if task.startswith("arc"):
        return [MCExample(f"Question: {r['question']}\nAnswer:", list(r["choices"]["text"]),
                          list(r["choices"]["label"]).index(r["answerKey"])) for r in rows]
    if task == "piqa":
        return [MCExample(f"Question: {r['goal']}\nAnswer:", [r["sol1"], r["sol2"]], int(r["label"])) for r in rows]
    return [(r["text"].rpartition(" ")[0], " " + r["text"].rpartition(" ")[2]) for r in rows]
