"""Writing a checkpoint atomically: everything goes into a hidden temp folder next to the
output, which is renamed into place only after the last byte is written. Any exception
(Ctrl-C included, and SIGTERM, which becomes a KeyboardInterrupt while the folder is open)
removes the temp folder, so an interrupted run leaves nothing behind; what a killed run (SIGKILL,
power loss) left is removed by the next run for the same output."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from fitllm.models.hub import as_umask_allows
from fitllm.quant.scheme import QuantError

SKIP_FILES = {"config.json", "model.safetensors.index.json"}


@contextlib.contextmanager
def atomic_output(out: Path, force: bool):
    out = Path(out)
    if out.exists() and not force:
        raise QuantError(f"{out}: already exists (pass --force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_runs(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        with _sigterm_interrupts():
            yield tmp
        if out.exists():  # --force: swap, then drop the old one
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _remove_dead_runs(out: Path) -> None:
    """Temp folders of earlier runs for `out` whose process is gone (killed: no cleanup ran)."""
    for stale in out.parent.glob(f".{out.name}.*-*"):
        kind, _, pid = stale.name[len(out.name) + 2:].partition("-")
        if kind in ("tmp", "old") and pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


@contextlib.contextmanager
def _sigterm_interrupts():
    """SIGTERM (kill, timeout, docker stop) raises KeyboardInterrupt, as Ctrl-C does, so the temp
    folder is removed; only where signals can be set (the main thread)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class ShardWriter:
    """Accumulate tensors and flush them to safetensors shards of about `shard_bytes`."""

    def __init__(self, folder: Path, shard_bytes: int = 2 << 30):
        self.folder, self.shard_bytes = folder, shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[tuple[str, list[str]]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.pending[name] = tensor.detach().to("cpu").contiguous()
        self.size += tensor.numel() * tensor.element_size()
        if self.size >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        name = f"part-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(self.folder / name), metadata={"format": "pt"})
        as_umask_allows(self.folder / name)
        self.files.append((name, list(self.pending)))
        self.pending, self.size = {}, 0

    def close(self) -> int:
        """Final names (model.safetensors, or model-0000i-of-0000n plus an index); total bytes."""
        self.flush()
        total = sum((self.folder / f).stat().st_size for f, _ in self.files)
        if len(self.files) == 1:
            (self.folder / self.files[0][0]).rename(self.folder / "model.safetensors")
            return total
        weight_map = {}
        for i, (f, names) in enumerate(self.files, 1):
            final = f"model-{i:05d}-of-{len(self.files):05d}.safetensors"
            (self.folder / f).rename(self.folder / final)
            weight_map.update({n: final for n in names})
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return total


def copy_side_files(src: Path, dst: Path) -> None:
    """Tokenizer, chat template, generation config: everything but weights and config.json."""
    for f in Path(src).iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in SKIP_FILES and not f.name.startswith("."):
            shutil.copy2(f, dst / f.name)
