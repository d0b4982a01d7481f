"""Multiple-choice tasks made from local text, for data no benchmark covers (source code, a private
corpus): JSON-lines files in the `context` / `choices` / `label` shape of `eval.tasks`.

    python -m muonrun.eval.text_tasks "$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')/json/*.py" tasks/

writes two tasks from the lines of the files (stripped lines of 40-80 characters with three spaces or
more), each in its own seeded order:

- `ending.jsonl`: a line cut at the space nearest its middle; the right choice is its real rest, the
  other that rest reversed. Both have the same characters, runs of them and length, so an untrained
  model is near chance (about 0.5) while one that learned the text's spelling is not.
- `last_word.jsonl`: a line without its last word; the choices are its last word and those of three
  other lines (the four distinct), in random order. Harder: it takes the text's sense, not only its
  spelling; its choices differ in length, so acc and acc_norm differ.

Take the lines from held-out text (the files of `data.eval_sources`), or the task measures memory.
"""

from __future__ import annotations

import argparse
import glob
import json
import random
from pathlib import Path


def text_lines(pattern: str) -> list[str]:
    """The candidate lines of the files `pattern` matches (`**` recurses), in file order."""
    lines = []
    for name in sorted(glob.glob(pattern, recursive=True)):
        for line in Path(name).read_text(encoding="utf-8", errors="replace").splitlines():
            line = line.strip()
            if 40 <= len(line) <= 80 and line.count(" ") >= 3:
                lines.append(line)
    return lines


def ending_task(lines: list[str], n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    order = list(dict.fromkeys(lines))  # each line once
    rng.shuffle(order)
    out = []
    for line in order:
        cuts = [i for i, c in enumerate(line) if c == " " and 10 <= i <= len(line) - 10]
        if not cuts:
            continue
        cut = min(cuts, key=lambda i: abs(i - len(line) // 2))
        context, rest = line[:cut], line[cut + 1 :]
        if rest == rest[::-1]:
            continue
        label = rng.randrange(2)
        choices = [rest, rest[::-1]] if label == 0 else [rest[::-1], rest]
        out.append({"context": context, "choices": choices, "label": label})
        if len(out) == n:
            break
    return out


def last_word_task(lines: list[str], n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed + 1)
    pairs = []
    for line in dict.fromkeys(lines):
        head, _, word = line.rpartition(" ")
        if len(head) >= 20 and 2 <= len(word) <= 20:
            pairs.append((head, word))
    rng.shuffle(pairs)
    words = [word for _, word in pairs]
    out = []
    for i, (head, word) in enumerate(pairs):
        others = list(dict.fromkeys(w for w in words[i + 1 : i + 40] if w != word))[:3]
        if len(others) < 3:
            continue
        choices = [word, *others]
        rng.shuffle(choices)
        out.append({"context": head, "choices": choices, "label": choices.index(word)})
        if len(out) == n:
            break
    return out


TASKS = {"ending": ending_task, "last_word": last_word_task}


def write_tasks(pattern: str, out: str | Path, examples: int = 500, seed: int = 0) -> dict[str, Path]:
    """Each task of TASKS as OUT/NAME.jsonl from the lines of `pattern`'s files; {name: path}."""
    lines = text_lines(pattern)
    if not lines:
        raise SystemExit(f"No file matching '{pattern}' has lines to make tasks from.")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, make in TASKS.items():
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in make(lines, examples, seed)))
        written[name] = path
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pattern", help="Files to take lines from (a glob; ** recurses).")
    parser.add_argument("out", help="Folder for the task files.")
    parser.add_argument("--examples", type=int, default=500, help="Examples per task.")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for name, path in write_tasks(args.pattern, args.out, args.examples, args.seed).items():
        count = len(path.read_text().splitlines())
        print(f"{name}: {count} examples in {path}  (eval.tasks=[{{name: {name}, path: {path}}}])")


if __name__ == "__main__":
    main()
