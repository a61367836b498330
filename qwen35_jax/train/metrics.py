"""What a run shows: metrics.jsonl (one row per step), TensorBoard events, loss.png (and reward.png of an
online RL run), the progress bar.

Only the lead process (process 0) writes. On resume, rows past the resumed step are dropped from
metrics.jsonl and TensorBoard purges its events past it, so every step appears once.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping
from typing import Any

from qwen35_jax.files import write_text_atomically
from qwen35_jax.run_layout import METRICS_FILE, PLOT_FILE, REWARD_PLOT_FILE


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    """The rows of RUN/metrics.jsonl (a torn last line, from a killed run, is ignored)."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf
    return value


class MetricsLog:
    """Appends one JSON row per step to RUN/metrics.jsonl and mirrors numbers to TensorBoard."""

    def __init__(self, run_dir: str, *, resume_step: int, lead: bool):
        self.run_dir, self.lead = run_dir, lead
        self._file = self._tb = None
        if not lead:
            return
        rows = [r for r in read_metrics(run_dir) if r.get("step", 0) <= resume_step]
        write_text_atomically(os.path.join(run_dir, METRICS_FILE), "".join(json.dumps(r) + "\n" for r in rows))
        self._file = open(os.path.join(run_dir, METRICS_FILE), "a")
        from tensorboardX import SummaryWriter
        self._tb = SummaryWriter(run_dir, purge_step=resume_step + 1 if resume_step else None)

    def write(self, row: Mapping[str, Any]) -> None:
        if not self.lead:
            return
        row = {k: _clean(v) for k, v in row.items()}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        for name, value in row.items():
            if name not in ("step", "time") and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._tb.add_scalar(f"train/{name}" if not name.startswith("eval_") else f"eval/{name[5:]}",
                                    value, row["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._tb.close()
            self._file = self._tb = None


def plot_loss(run_dir: str) -> str | None:
    """RUN/loss.png: the training loss (and held-out loss, when logged) against the step."""
    return plot_metric(run_dir, "loss", "eval_loss", PLOT_FILE, ("train loss", "held-out loss"))


def plot_reward(run_dir: str) -> str | None:
    """RUN/reward.png (online RL): the mean reward of the sampled completions (and the greedy held-out
    reward, when logged) against the step."""
    return plot_metric(run_dir, "reward_mean", "eval_reward", REWARD_PLOT_FILE,
                       ("sampled reward (mean)", "held-out greedy reward"))


def plot_metric(run_dir: str, key: str, eval_key: str, file: str, labels: tuple[str, str]) -> str | None:
    """RUN/`file`: metrics.jsonl's `key` (and `eval_key`, when logged) against the step; None without rows."""
    rows = read_metrics(run_dir)
    train = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    evals = [(r["step"], r[eval_key]) for r in rows if r.get(eval_key) is not None]
    if not train:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(*zip(*train), label=labels[0], linewidth=1.2)
    if evals:
        ax.plot(*zip(*evals), "o-", label=labels[1], markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel(key.split("_")[0])
    ax.set_title(os.path.basename(os.path.abspath(run_dir)))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = os.path.join(run_dir, file)
    fig.savefig(path)
    plt.close(fig)
    return path


class Progress:
    """A tqdm bar (loss, tokens/s, ETA) on a terminal; one plain line per step otherwise."""

    def __init__(self, *, total: int, initial: int, enabled: bool, lead: bool):
        self.lead = lead
        self.bar = None
        if lead and enabled and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
        self.total = total

    def update(self, row: Mapping[str, Any]) -> None:
        if not self.lead:
            return
        loss = row.get("loss")
        text = f"loss {loss:.4f}" if loss is not None else "loss nan"
        if self.bar is not None:
            reward = f" reward {row['reward_mean']:.3f}" if row.get("reward_mean") is not None else ""
            self.bar.set_postfix_str(f"{text}{reward} tok/s {row['tokens_per_sec']:,.0f}", refresh=False)
            self.bar.update(1)
            return
        extra = "".join(f" {k} {row[k]:.4g}" for k in ("reward_mean", "eval_loss", "eval_reward", "kl", "clip_fraction",
                                                        "logprob_mismatch") if row.get(k) is not None)
        print(f"step {row['step']}/{self.total} {text} grad_norm {row['grad_norm'] or float('nan'):.4f} "
              f"lr {row['lr']:.3g} tokens {int(row['tokens'])} tok/s {row['tokens_per_sec']:,.0f}"
              f"{extra}{' (skipped)' if not row.get('applied', 1) else ''}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
