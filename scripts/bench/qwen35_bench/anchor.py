"""The anchor check: is the harness's transformers step the one a transformers user gets?

Each round of `bench_train.py --stack both` also runs `plain_transformers.py` (a user's training loop
importing torch and transformers only, nothing of ours) on every train-step row's config, batch and
sequence, right beside the harness's own transformers child (the two take turns going first, round
by round, so both see the same drift of the machine). A row's check is the median over rounds of
harness / plain; outside 1 +- the tolerance, the ratios the harness reports are not against
transformers as its users run it, and bench_train says so loudly (or fails, with --anchor-check fail).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

PLAIN_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plain_transformers.py")
KEY = "anchor"


def run_plain(planned: list[tuple[str, object, int, int]], steps: int, tmp: str, tag: str) -> list[dict | None]:
    """`plain_transformers.py` on each (name, Qwen35Config, batch, seq), one process per row (`-P`: the
    script's folder is not put on sys.path, so it imports exactly what a user's script would); None
    where it failed, which costs that row its check, not the run."""
    out = []
    for i, (_, config, batch, seq) in enumerate(planned):
        config_path = os.path.join(tmp, f"plain{tag}_{i}.config.json")
        result_path = os.path.join(tmp, f"plain{tag}_{i}.json")
        with open(config_path, "w") as f:
            json.dump(config.to_hf_dict(), f)
        cmd = [sys.executable, "-P", PLAIN_SCRIPT, config_path, "--batch", str(batch), "--seq", str(seq),
               "--steps", str(steps), "--json", result_path]
        if subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode != 0:  # its error went to stderr
            print(f"bench_train: the plain transformers process failed on {planned[i][0]}: no anchor check "
                  "for that row", file=sys.stderr)
            out.append(None)
            continue
        with open(result_path) as f:
            out.append({**json.load(f), "load_average": os.getloadavg()[0]})
    return out


def attach(rows: list[dict], by_round: list[list[dict]], per_round_plain: list[list[dict]]) -> None:
    """Adds `anchor` to each train-step row of `rows` (merged over rounds; the train steps come first,
    one per entry of a round's plain timings): the harness's (`by_round`: each round's rows) and the
    plain process's median per round, their ratios and the median ratio."""
    for i, row in enumerate(rows[:len(per_round_plain[0]) if per_round_plain else 0]):
        if any(r[i] is None for r in per_round_plain):  # the plain process failed (it said so)
            continue
        harness = [r[i]["transformers"]["median_s"] for r in by_round]
        plain = [r[i]["median_s"] for r in per_round_plain]
        ratios = [h / p for h, p in zip(harness, plain)]
        row[KEY] = {"harness_s": harness, "plain_s": plain, "round_ratios": ratios,
                    "ratio": statistics.median(ratios), "plain_median_s": statistics.median(plain),
                    "plain_min_s": min(r[i]["min_s"] for r in per_round_plain),
                    "plain_max_s": max(r[i]["max_s"] for r in per_round_plain),
                    "plain_threads": per_round_plain[0][i]["threads"]}


def report(rows: list[dict], tolerance: float) -> tuple[list[str], bool]:
    """Lines to print under the table, and whether every checked row is within tolerance."""
    lines, ok = [], True
    checked = [r for r in rows if KEY in r]
    if not checked:
        return lines, ok
    lines.append(f"\nanchor check: transformers in the harness's child / in a plain transformers process "
                 f"({os.path.basename(PLAIN_SCRIPT)}), paired by round, tolerance {tolerance:.0%}:")
    for r in checked:
        a = r[KEY]
        rounds = ", ".join(f"{x:.2f}" for x in a["round_ratios"])
        within = abs(a["ratio"] - 1) <= tolerance
        ok &= within
        lines.append(f"  {r['config']} {r['batch']} x {r['seq']}: harness {r['transformers']['median_s']:.3f} s "
                     f"({r['transformers']['min_s']:.3f}-{r['transformers']['max_s']:.3f}), plain "
                     f"{a['plain_median_s']:.3f} s ({a['plain_min_s']:.3f}-{a['plain_max_s']:.3f}): "
                     f"{a['ratio']:.2f}x (rounds: {rounds}) {'ok' if within else 'OUTSIDE TOLERANCE'}")
    if not ok:
        bar = "!" * 100
        lines += [bar, "WARNING: the harness's transformers time differs from a plain transformers process's by "
                  f"more than {tolerance:.0%}.", "The ratios above are then not against transformers as its users "
                  "run it. On a loaded or drifting machine torch's two spinning OpenMP threads slow down far "
                  "more than XLA's:", "re-run when the load average is near 0 (the header prints it) before "
                  "quoting any ratio.", bar]
    return lines, ok
