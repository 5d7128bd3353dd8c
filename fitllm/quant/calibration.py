"""Calibration token batches: `--calib FILE` (.txt or .jsonl), a Hugging Face dataset name
(`hf:NAME[:CONFIG[:SPLIT]]`, needs the network and the `datasets` package), or the built-in
default, which needs neither: text the model writes itself from a fixed, diverse set of prompts
(sampled with a fixed seed and cached), so no corpus is shipped or downloaded."""
from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Optional

import torch

from fitllm.models.hub import cache_root
from fitllm.quant.scheme import QuantError

# Topics spread over prose, dialogue, code, maths, lists and instructions so the activations
# seen during calibration resemble what the model will serve. Written for fitllm.
PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how photosynthesis works to a ten-year-old.",
    "Write a Python function that checks whether a string is a palindrome, with comments.",
    "What were the main causes of the fall of the Western Roman Empire?",
    "Give me a recipe for a vegetable soup that takes less than thirty minutes.",
    "Describe the water cycle step by step.",
    "Write a polite email asking a landlord to fix a leaking kitchen tap.",
    "Solve: a train travels 180 km in 2.5 hours. What is its average speed? Show your work.",
    "List ten tips for staying focused while studying at home.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a poem about autumn leaves in a city park.",
    "How does a vaccine train the immune system?",
    "Summarise the plot of a detective story set on a night train, in your own words.",
    "Write a SQL query that returns the five customers with the highest total order value.",
    "What is the Pythagorean theorem and how is it used in construction?",
    "Describe a day in the life of a honeybee.",
    "Explain what inflation is and how central banks try to control it.",
    "Write a dialogue between a teacher and a student who forgot their homework.",
    "How do I make my bicycle chain stop squeaking?",
    "Explain recursion with an example in JavaScript.",
    "What are black holes and how do astronomers detect them?",
    "Write a product description for a waterproof hiking backpack.",
    "Give a brief history of the printing press and its effects on society.",
    "What are the health benefits of regular walking?",
    "Write a bash script that renames all .txt files in a folder to .md.",
    "Explain the rules of chess for a complete beginner.",
    "Describe how a bill becomes a law in a parliamentary democracy.",
    "Write a cover letter for a junior data analyst position.",
    "Why is the sky blue? Explain the physics.",
    "Compare renewable and non-renewable energy sources in a short essay.",
    "Write a fairy tale about a fox who wants to learn to fly.",
    "Explain how a hash table works and what a collision is.",
    "What should I pack for a three-day camping trip in the mountains?",
    "Translate into simple English and explain: 'The early bird catches the worm.'",
    "Describe the life cycle of a star like the Sun.",
    "Write unit tests in Python for a function that adds two numbers.",
    "What is machine learning? Give three everyday examples.",
    "Plan a one-week vegetarian meal plan for a family of four.",
    "Explain how compound interest works with a numerical example.",
    "Write a letter from a sailor to his family in the year 1850.",
]


def load_calibration(folder: Path, tokenizer, samples: int, length: int, calib: Optional[str] = None,
                     model_loader=None, progress: bool = False) -> torch.Tensor:
    """[samples, length] token ids (fewer rows if the source is short; at least one). progress: a bar
    while the built-in text is generated (minutes on a CPU, the first time for a model and size)."""
    if samples < 1 or length < 16:
        raise QuantError(f"--calib-samples/--calib-len: need at least 1 sample of 16 tokens (got {samples} x {length})")
    if calib is None:
        return builtin_calibration(folder, tokenizer, samples, length, model_loader, progress)
    if calib.startswith("hf:"):
        text = _hf_text(calib[3:])
    else:
        text = _file_text(Path(calib))
    ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    n = min(samples, ids.numel() // length)
    if n < 1:
        raise QuantError(f"--calib {calib}: only {ids.numel()} tokens, need at least --calib-len {length}")
    # evenly spaced windows over the whole text
    starts = torch.linspace(0, ids.numel() - length, n).long()
    return torch.stack([ids[s:s + length] for s in starts.tolist()])


def _file_text(path: Path) -> str:
    if not path.exists():
        raise QuantError(f"--calib {path}: no such file")
    raw = path.read_text(errors="replace")
    if path.suffix == ".jsonl":
        texts = []
        for i, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise QuantError(f"--calib {path}: line {i} is not JSON") from None
            text = row.get("text") if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise QuantError(f"--calib {path}: line {i} has no string field 'text'")
            texts.append(text)
        return "\n\n".join(texts)
    return raw


def _hf_text(spec: str) -> str:
    name, config, split = (spec.split(":") + [None, None])[:3]
    try:
        import datasets
    except ImportError:
        raise QuantError(f"--calib hf:{spec}: the `datasets` package is not installed") from None
    try:
        ds = datasets.load_dataset(name, config, split=split or "train")
    except Exception as exc:
        raise QuantError(f"--calib hf:{spec}: cannot load the dataset ({exc.__class__.__name__}: {exc})") from None
    return "\n\n".join(t for t in ds["text"][:20000] if t and t.strip())


def builtin_calibration(folder: Path, tokenizer, samples: int, length: int, model_loader=None,
                        progress: bool = False) -> torch.Tensor:
    """The model's own answers to PROMPTS (temperature 0.8, seed 0), cached by model and size."""
    key = hashlib.sha256()
    for name in ("config.json", "model.safetensors", "model.safetensors.index.json"):
        p = Path(folder) / name
        if p.exists():
            key.update(f"{name}:{p.stat().st_size}:{p.stat().st_mtime_ns}".encode())
    key.update(f"{samples}x{length}:v1".encode())
    path = cache_root() / "calib" / f"{key.hexdigest()[:16]}.pt"
    if path.exists():
        return torch.load(path)
    from fitllm.models.generate import generate

    model = model_loader() if model_loader else None
    if model is None:
        from fitllm.models.loader import load_model

        model = load_model(Path(folder), "cpu", torch.float32)
    prompts = []
    for i in range(samples):
        chat = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        try:
            ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        except Exception:  # no chat template: plain text prompt
            ids = tokenizer(PROMPTS[i % len(PROMPTS)])["input_ids"]
        prompts.append(list(ids)[: length // 2])
    new = max(length - min(len(p) for p in prompts), 1)
    # eos ignored on purpose: every row runs to full length (the model starts a new turn)
    with _generation_bar(progress, samples, new) as step:
        outs = generate(model, prompts, max_new_tokens=new, temperature=0.8, seed=0, eos_token_ids=None,
                        on_step=step)
    rows = torch.tensor([(p + o)[:length] for p, o in zip(prompts, outs)], dtype=torch.long)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(rows, tmp)
    tmp.replace(path)
    return rows


@contextlib.contextmanager
def _generation_bar(show: bool, samples: int, steps: int):
    """A rich bar over the built-in text's decode steps (or nothing): the first convert of a model
    spends most of its time here, and said nothing before."""
    if not show:
        yield None
        return
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    with Progress(TextColumn(f"calibration text: the model writes {samples} samples (cached afterwards)"),
                  BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                  transient=True) as bar:
        task = bar.add_task("generate", total=steps)
        yield lambda: bar.advance(task)
