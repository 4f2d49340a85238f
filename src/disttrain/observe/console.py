"""Rank 0's console: a live progress bar on a terminal, plain lines when output is a file or pipe."""

from __future__ import annotations

import sys
import time

from disttrain.observe.sinks import Sink


def _fmt_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def start_line(model: str, num_params: int, layout, device: str, tokenizer: str | None, per_step: str,
               trainable: int | None = None) -> str:
    """The first line of a run: what trains (under LoRA: how much of it), how it is cut over the world, on which
    tokens."""
    tok = f"tokenizer {tokenizer}" if tokenizer else "no tokenizer (the dataset gives ids)"
    share = "" if trainable is None else \
        f" ({trainable / 1e6:.2f}M trainable, {100 * trainable / num_params:.2f}%: the LoRA adapters)"
    return (f"model {model}: {num_params / 1e6:.2f}M parameters{share} | world {layout.world_size}: "
            f"{layout.describe()} on {device} | {tok} | {per_step} per step")


def optimizer_line(split: dict) -> str:
    """Which algorithm trains how much of the model (optim.name=muon)."""
    parts = [f"{name if name == 'adamw' else name.capitalize()} on {len(e['names'])} tensors "
             f"({e['params'] / 1e6:.2f}M parameters, {e['bytes'] / 2 ** 20:.1f} MiB)" for name, e in split.items()]
    line = "optimizer: " + ", ".join(parts).replace("adamw", "AdamW")
    if "muon" not in split:  # a model whose blocks are named otherwise (a user's model.spec)
        line += "; Muon on nothing: no parameter is in a repeated block named layers.N or h.N"
    return line


def announce(metrics, *, step: int, world_size: int, layout, model: str, num_params: int, trainable: int | None, device: str,
             tokenizer: str | None, per_step: str, warnings: list[str], shares: list[int] | None = None,
             rebalance_every: int = 0, skipped: list[str] = (), checkpoint_dir: str = "",
             resumed_from: str | None = None, changes: dict | None = None, optimizer_split: dict | None = None,
             attention: str = "", loss: str = "", float8: str = "") -> None:
    """What a run says as it starts, on the console and as events: the start line, warnings, uneven shares,
    checkpoints that could not be loaded, and where it resumed from with what changed since."""
    metrics.event("started", step=step, world_size=world_size, layout=layout.describe(), num_params=num_params,
                  **({} if trainable is None else {"trainable_params": trainable}),
                  **({"attention": attention} if attention else {}), **({"logits": loss} if loss else {}),
                  **({"float8": float8} if float8 else {}))
    metrics.message(start_line(model, num_params, layout, device, tokenizer, per_step, trainable))
    if attention and attention != "sdpa":  # a kernel other than the default: say which and why
        metrics.message(f"attention: {attention}")
    if float8:
        metrics.message(f"float8: {float8}")
    if "whole logits (" in loss:  # train.loss_chunk_tokens asked for chunks a model cannot take
        metrics.message(f"loss: {loss}")
    if optimizer_split:
        metrics.event("optimizer_split", stage_only=layout.pp > 1, **optimizer_split)
        metrics.message(optimizer_line(optimizer_split) + (" (pipeline stage 0)" if layout.pp > 1 else ""))
    for line in warnings:
        metrics.event("warning", message=line)
        metrics.message(f"warning: {line}")
    if shares is not None:
        metrics.event("balance", step=step, shares=list(shares), mode=layout.balance,
                      weights=list(layout.balance_weights))
        metrics.message(f"uneven shares: micro-batches per data-parallel rank {list(shares)}"
                        + (f", re-split every {rebalance_every} steps by measured speed" if rebalance_every else ""))
    for problem in skipped:
        metrics.event("checkpoint_skipped", reason=problem)
        metrics.message(f"warning: skipped checkpoint: {problem}")
    if skipped and not resumed_from:
        metrics.message(f"warning: no checkpoint in {checkpoint_dir} could be loaded: starting fresh")
    if resumed_from:
        metrics.event("resumed", step=step, path=resumed_from, world_size=world_size, config_changes=changes or {})
        metrics.message(f"resumed from {resumed_from} at step {step}")
        for line in (changes or {}).get("safe", []):
            metrics.message(f"  changed since the checkpoint (safe): {line}")
        for line in (changes or {}).get("trajectory", []):
            metrics.message(f"  changed since the checkpoint (the run will differ): {line}")


def _event_line(name: str, fields: dict) -> str | None:
    """Events people should see as they happen (the rest stay in metrics.jsonl)."""
    if name == "checkpoint_saved":
        how = "" if fields.get("reason", "interval") == "interval" else f", {fields['reason']}"
        return f"checkpoint: step {fields['step']} saved to {fields['path']} ({fields['seconds']:.1f} s{how})"
    return None


class ConsoleProgress(Sink):
    """A live rich progress bar on a terminal; plain lines when output is a file or pipe."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool):
        self.total, self.enabled = total_steps, enabled
        self.start_step = start_step
        self.t0 = time.perf_counter()
        self._progress = None
        if enabled and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[info]}"), TimeRemainingColumn())
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, info="")
            self._progress.start()

    def log_step(self, record: dict) -> None:
        if not self.enabled:
            return
        step = record["step"]
        done = step - self.start_step
        rate = done / max(1e-9, time.perf_counter() - self.t0)
        eta = (self.total - step) / rate if rate > 0 else 0.0
        info = f"loss {record['loss']:.4f} | {record['tokens_per_sec']:,.0f} tok/s"
        if "mfu" in record:
            info += f" | mfu {100 * record['mfu']:.1f}%"
        if self._progress is not None:
            self._progress.update(self._task, completed=step, info=info)
        else:
            width = len(str(self.total))
            print(f"step {step:>{width}}/{self.total} | {info} | lr {record['lr']:.2e} | eta {_fmt_duration(eta)}",
                  flush=True)

    def event(self, name: str, fields: dict) -> None:
        line = _event_line(name, fields)
        if line is not None:
            self.message(line)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
