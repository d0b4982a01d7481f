"""ns_quality.sh's comparison: the run folders of one seed each, and with several seeds their means.

    python benchmarks/ns_quality_compare.py STUDY_REFERENCE_DIR OUT_DIR [OUT_DIR...]

Each OUT_DIR may hold ``reference``, ``reference-2`` and ``defaults`` (the 1.5B runs) and ``study-muon``,
``study-normuon`` (the study with the candidate), ``study-muon-base``, ``study-normuon-base`` (without
it). Per folder: the single-seed checks ns_quality.sh describes. With several folders: the mean over
them of each signed relative difference (candidate over reference, minus 1) against the same bounds,
and on how many of them the candidate's loss is the higher one. Reads metrics.jsonl only.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

STEP_BOUND, TAIL_BOUND, STUDY_BOUND = 0.01, 0.005, 0.005
STUDY_REFERENCE_SEED = 42  # the seed of docs/data/study's runs


def rows(path: Path) -> list[dict]:
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    )


def losses(run: Path) -> dict[int, float]:
    """The training loss at every 10th step."""
    return {r["step"]: r["loss"] for r in rows(run / "metrics.jsonl") if "loss" in r and r["step"] % 10 == 0}


def final_eval(run: Path) -> float:
    evals = [r["eval_loss"] for r in rows(run / "metrics.jsonl") if "eval_loss" in r]
    return evals[-1] if evals else math.nan


def seed_of(run: Path) -> int | None:
    config = run / "config.yaml"
    lines = config.read_text().splitlines() if config.exists() else []
    return next((int(s.split(":")[1]) for s in lines if s.strip().startswith("seed:")), None)


def signed(a: dict[int, float], b: dict[int, float]) -> dict[int, float]:
    """``b / a - 1`` at the steps both have."""
    return {s: b[s] / a[s] - 1 for s in sorted(set(a) & set(b))}


def tail_mean(x: dict[int, float]) -> float:
    """The mean over the run's last third: steadier than single steps (on an H200 three of [v6]'s runs
    part by 0.2-0.6% on it, against 1.0-1.5% at single steps)."""
    steps = [s for s in sorted(x) if s > 2 * max(x) // 3]
    return sum(x[s] for s in steps) / len(steps) if steps else math.nan


def verdict(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def one_seed(out: Path, study_reference: Path) -> dict:
    """Print one folder's checks; return its signed differences for the means."""
    print(f"== {out}")
    found: dict = {}
    a, b, a2 = losses(out / "reference"), losses(out / "defaults"), losses(out / "reference-2")
    diffs = signed(a, b)
    if diffs:
        at = max(diffs, key=lambda s: abs(diffs[s]))
        spread = max((abs(d) for d in signed(a, a2).values()), default=math.nan)
        bound = max(STEP_BOUND, spread) if a2 else STEP_BOUND
        print(
            f"1.5B, {len(diffs)} logged steps: largest relative loss difference {abs(diffs[at]):.4%} at step {at}"
            f" (the candidate {'higher' if diffs[at] > 0 else 'lower'})"
        )
        if a2:
            print(f"  the two reference runs: largest relative difference {spread:.4%}")
        print(
            f"  limit {bound:.4%} (1%, or the references' own difference where more): {verdict(abs(diffs[at]) <= bound)}"
        )
        tail = tail_mean(b) / tail_mean(a) - 1
        tail_spread = abs(tail_mean(a2) / tail_mean(a) - 1) if a2 else math.nan
        tail_bound = max(TAIL_BOUND, tail_spread) if a2 else TAIL_BOUND
        print(
            f"  mean loss over the last third: defaults {tail:+.4%} from the reference"
            + (f", reference-2 {tail_spread:.4%}" if a2 else "")
            + f"; limit {tail_bound:.4%} (0.5%, or the references' own): {verdict(abs(tail) <= tail_bound)}"
        )
        for s in sorted(diffs)[:: max(1, len(diffs) // 10)]:
            second = f"  reference-2 {a2[s]:.4f}" if s in a2 else ""
            print(f"  step {s:4d}  reference {a[s]:.4f}{second}  defaults {b[s]:.4f}")
        found["steps"], found["tail"] = diffs, tail
    else:
        print("1.5B: no reference and defaults runs to compare")
    for v in ("muon", "normuon"):
        run, base = out / f"study-{v}", out / f"study-{v}-base"
        if not run.exists():
            continue
        new = final_eval(run)
        if base.exists():
            old, against = final_eval(base), "the same seed without the candidate"
        elif seed_of(run) == STUDY_REFERENCE_SEED:
            old, against = final_eval(study_reference / f"{v}-lr0.01-seed42"), "docs/data/study"
        else:  # docs/data/study holds seed 42 only: nothing to compare with
            print(
                f"study-{v}: seed {seed_of(run)}, no study-{v}-base beside it and docs/data/study holds"
                f" seed 42 only: not compared (its final eval loss {new:.4f})"
            )
            continue
        rel = new / old - 1
        print(
            f"study-{v}: final eval loss {new:.4f} vs {old:.4f} ({against}; {rel:+.3%}, limit 0.5%):"
            f" {verdict(abs(rel) <= STUDY_BOUND)}"
        )
        found[f"study-{v}"] = rel
    return found


def means(found: list[dict]) -> None:
    """The checks on the means over the seeds."""
    with_steps = [f for f in found if "steps" in f]
    print(f"== means over {len(found)} seeds")
    if with_steps:
        common = sorted(set.intersection(*(set(f["steps"]) for f in with_steps)))
        mean_at = {s: statistics.mean(f["steps"][s] for f in with_steps) for s in common}
        at = max(mean_at, key=lambda s: abs(mean_at[s]))
        print(
            f"1.5B, {len(with_steps)} seeds: largest mean relative difference {mean_at[at]:+.4%} at step {at};"
            f" limit 1%: {verdict(abs(mean_at[at]) <= STEP_BOUND)}"
        )
        tails = [f["tail"] for f in with_steps]
        tail = statistics.mean(tails)
        spread = f", standard deviation {statistics.stdev(tails):.4%}" if len(tails) > 1 else ""
        print(
            f"  mean loss over the last third: {tail:+.4%} on average ({', '.join(f'{t:+.2%}' for t in tails)}{spread});"
            f" the candidate higher on {sum(t > 0 for t in tails)} of {len(tails)}; limit 0.5%:"
            f" {verdict(abs(tail) <= TAIL_BOUND)}"
        )
    for v in ("muon", "normuon"):
        rels = [f[f"study-{v}"] for f in found if f"study-{v}" in f]
        if rels:
            rel = statistics.mean(rels)
            print(
                f"study-{v}, {len(rels)} seeds: final eval loss {rel:+.3%} on average"
                f" ({', '.join(f'{r:+.2%}' for r in rels)}); the candidate higher on {sum(r > 0 for r in rels)}"
                f" of {len(rels)}; limit 0.5%: {verdict(abs(rel) <= STUDY_BOUND)}"
            )


def main(argv: list[str]) -> None:
    study_reference, outs = Path(argv[0]), [Path(p) for p in argv[1:]]
    found = [one_seed(out, study_reference) for out in outs]
    if len(outs) > 1:
        means(found)


if __name__ == "__main__":
    main(sys.argv[1:])
