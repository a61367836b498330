"""Benchmark rows: merging paired rounds and the markdown tables docs/results.md quotes.

A row is a dict with "config", "batch", "seq" (and "remat" for a train step) and one timing dict per
stack: "transformers" and "ours" or "ours <variant>", each with median_s, min_s and max_s (seconds).
"""

from __future__ import annotations

import json
import statistics


def merge_rounds(rounds: list[dict]) -> dict:
    """One row from its rounds: each stack's median_s is the median of the rounds' medians, min_s and
    max_s the extremes over all of them; each variant of ours gains `round_ratios`, theirs / ours per
    round, and `ratio`, their median (paired by round, so drift between rounds cancels)."""
    if len(rounds) == 1:
        return rounds[0]
    row = json.loads(json.dumps(rounds[0]))
    stacks = [k for k in row if k == "transformers" or k.startswith("ours")]
    for stack in stacks:
        row[stack]["median_s"] = statistics.median(r[stack]["median_s"] for r in rounds)
        row[stack]["min_s"] = min(r[stack]["min_s"] for r in rounds)
        row[stack]["max_s"] = max(r[stack]["max_s"] for r in rounds)
    if "transformers" in row:
        for stack in stacks:
            if stack.startswith("ours"):
                row[stack]["round_ratios"] = [r["transformers"]["median_s"] / r[stack]["median_s"] for r in rounds]
                row[stack]["ratio"] = statistics.median(row[stack]["round_ratios"])
    return row


def table(rows: list[dict]) -> str:
    """Markdown: one line per variant of ours (or per row, for transformers alone), with tokens/s, MFU
    where known, and the ratio theirs / ours in time (its rounds' ratios beside it)."""
    lines = ["| run | B x S | transformers s | ours s | ours tok/s | ours / theirs |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        theirs = r.get("transformers", {}).get("median_s")
        theirs_s = f"{theirs:.3f}" if theirs else "-"
        names = [k for k in r if k.startswith("ours")]
        if not names:  # transformers alone
            lines.append(f"| {r['config']} | {r['batch']} x {r['seq']} | {theirs_s} | - | - | - |")
        for name in names:
            ours = r[name]["median_s"]
            tok = r["batch"] * r["seq"] / ours
            ratio = f"{r[name].get('ratio') or theirs / ours:.2f}x" if theirs else "-"
            if len(r[name].get("round_ratios", [])) > 1:
                ratio += " (rounds: " + ", ".join(f"{x:.2f}" for x in r[name]["round_ratios"]) + ")"
            extra = f" (MFU {r[name]['mfu']:.1%})" if "mfu" in r[name] else ""
            label = r["config"] + name[4:] + (f", remat {r['remat']}" if "remat" in r else "")
            lines.append(f"| {label} | {r['batch']} x {r['seq']} | {theirs_s} | {ours:.3f} | {tok:,.0f}{extra} | "
                         f"{ratio} |")
    return "\n".join(lines)


def breakdown_table(pieces: list[dict]) -> str:
    """Markdown: forward and forward+backward seconds of each piece (`breakdown.time_pieces`)."""
    lines = ["| piece | fwd s | fwd+bwd s | bwd / fwd |", "| --- | --- | --- | --- |"]
    for r in pieces:
        lines.append(f"| {r['piece'].strip()} | {r['fwd_s']:.3f} | {r['fwd_bwd_s']:.3f} | "
                     f"{(r['fwd_bwd_s'] - r['fwd_s']) / r['fwd_s']:.2f} |")
    return "\n".join(lines)


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A markdown table of `rows` (cells printed with str) under `header`."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
