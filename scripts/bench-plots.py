#!/usr/bin/env python3
"""The current GPU table and the plots of BENCHMARKS.md, from the benchmark's
own output.

Inputs, as the programs print them:
  --bench FILE...   gpu_bench's output (scripts/gpu-run.sh saves it as
                    OUTDIR/bench.md), one file per run: its table whose header
                    starts `| cache | layout | case |`, with a `NAME GB/s` and a
                    `fraction` column per algorithm (any algorithms, in the
                    order printed). Several runs give medians and ranges.
  --catalogue FILE  the fault catalogue's output (`cargo test --release --test
                    fault_catalogue -- --nocapture`): its table whose header
                    starts `| kind | fault class | path | trials |`, with
                    `NAME detected` and `NAME missed` columns per algorithm.

Outputs, under --out (default docs/img):
  gpu-throughput.svg   each case's throughput as a fraction of the read
                       ceiling measured in the same run, per algorithm
                       (bars: median; whiskers: range over the runs)
  fault-catalogue.svg  each fault class's missed fraction per algorithm
and, with --update BENCHMARKS.md, the table between the markers
`<!-- gpu-table: begin -->` and `<!-- gpu-table: end -->` in that file
(without it, the table is printed).

The card, date and commit come from --card, --date and --commit; where one is
not given, from a `run.txt` beside the first bench file (`card: ...`,
`date: ...`, `commit: ...`, as scripts/gpu-run.sh writes it), and the card
from that file's `device:` line. Plotting needs matplotlib (`make plots` installs a pinned one into
build/plots-venv); --table-only writes the table without it.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
from dataclasses import dataclass, field

BEGIN = "<!-- gpu-table: begin -->"
END = "<!-- gpu-table: end -->"


def table_rows(lines: list[str], header_start: str) -> tuple[list[str], list[list[str]]]:
    """The first markdown table whose header row starts with `header_start`:
    its header cells and its rows' cells."""
    for at, line in enumerate(lines):
        if line.startswith(header_start):
            header = cells(line)
            rows = []
            for row in lines[at + 1 :]:
                if not row.startswith("|"):
                    # gpu_bench prints the kernels' register use between the
                    # header and the first row: the table ends only after one.
                    if rows:
                        break
                    continue
                if re.fullmatch(r"\|[-:| ]+\|", row.strip()):
                    continue
                found = cells(row)
                if len(found) != len(header):
                    sys.exit(f"a row with {len(found)} cells under a header of {len(header)}: {row.strip()}")
                rows.append(found)
            if not rows:
                sys.exit(f"the table `{header_start} ...` has no rows")
            return header, rows
    sys.exit(f"no table whose header starts `{header_start}`")


def cells(line: str) -> list[str]:
    return [cell.strip().strip("*") for cell in line.strip().strip("|").split("|")]


@dataclass
class Case:
    """One row of gpu_bench's table over every run that has it."""

    cache: str
    layout: str
    case: str
    bytes_read: str
    ceilings: list[float] = field(default_factory=list)
    fractions: dict[str, list[float]] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.cache}, {self.layout}, {self.case}"


def read_bench(paths: list[str]) -> tuple[list[str], list[Case], str | None]:
    """The algorithms, the cases in the order printed, and the card named on
    the first file's `device:` line."""
    algorithms: list[str] | None = None
    cases: dict[tuple[str, str, str], Case] = {}
    card = None
    for path in paths:
        with open(path, encoding="utf-8") as file:
            lines = file.read().splitlines()
        if card is None:
            for line in lines:
                if line.startswith("device: "):
                    card = line[len("device: ") :].split(";")[0].strip()
                    break
        header, rows = table_rows(lines, "| cache | layout | case |")
        names = [
            m.group(1)
            for m in (re.fullmatch(r"(\S+) GB/s", h) for h in header)
            if m and m.group(1) != "ceiling"
        ]
        if algorithms is None:
            algorithms = names
        elif names != algorithms:
            sys.exit(f"{path}: algorithms {names}, the first file has {algorithms}")
        ceiling_at = header.index("read ceiling GB/s")
        fraction_at = {name: header.index(f"{name} GB/s") + 1 for name in names}
        for name, at in fraction_at.items():
            if header[at] != "fraction":
                sys.exit(f"{path}: `{name} GB/s` is not followed by a `fraction` column")
        for row in rows:
            key = (row[0], row[1], row[2])
            case = cases.setdefault(key, Case(row[0], row[1], row[2], row[3]))
            case.ceilings.append(float(row[ceiling_at]))
            for name, at in fraction_at.items():
                case.fractions.setdefault(name, []).append(float(row[at]))
    return algorithms or [], list(cases.values()), card


def summary(values: list[float]) -> str:
    median = statistics.median(values)
    if len(values) == 1:
        return f"{median:.3f}"
    return f"{median:.3f} ({min(values):.3f}-{max(values):.3f})"


def bench_table(algorithms: list[str], cases: list[Case], card: str, date: str, commit: str, runs: int) -> str:
    what = "one run" if runs == 1 else f"median of {runs} runs, and in parentheses their range"
    lines = [
        f"Card: {card}.",
        f"Date: {date}. Commit: `{commit}`. Command: `.device/bin/gpu_bench`.",
        "",
        "Each cell is the throughput as a fraction of the read ceiling measured in",
        f"the same run ({what}); the read ceiling is",
        "a plain read of the same bytes on the same card.",
        "",
        "| cache | layout | case | bytes read | read ceiling GB/s | " + " | ".join(algorithms) + " |",
        "|---|---|---|---:|---:|" + "---:|" * len(algorithms),
    ]
    for case in cases:
        values = " | ".join(summary(case.fractions[name]) for name in algorithms)
        ceiling = statistics.median(case.ceilings)
        lines.append(f"| {case.cache} | {case.layout} | {case.case} | {case.bytes_read} | {ceiling:.0f} | {values} |")
    return "\n".join(lines) + "\n"


def read_catalogue(path: str) -> tuple[list[str], list[tuple[str, int, dict[str, int]]], str]:
    """The algorithms, and per fault class (engine and direct paths added up)
    its trials and misses per algorithm; and the catalogue's first line."""
    with open(path, encoding="utf-8") as file:
        lines = file.read().splitlines()
    heading = next((line for line in lines if line.startswith("fault catalogue:")), "")
    header, rows = table_rows(lines, "| kind | fault class | path | trials |")
    algorithms = [m.group(1) for m in (re.fullmatch(r"(\S+) missed", h) for h in header) if m]
    trials_at = header.index("trials")
    missed_at = {name: header.index(f"{name} missed") for name in algorithms}
    classes: dict[str, tuple[int, dict[str, int]]] = {}
    for row in rows:
        trials, missed = classes.setdefault(row[1], (0, {name: 0 for name in algorithms}))
        for name, at in missed_at.items():
            missed[name] += int(row[at])
        classes[row[1]] = (trials + int(row[trials_at]), missed)
    return algorithms, [(name, t, m) for name, (t, m) in classes.items()], heading


def plots(out: str, algorithms, cases, card, date, commit, runs, catalogue) -> list[str]:
    import matplotlib

    matplotlib.use("svg")
    import matplotlib.pyplot as plt

    # The same input gives the same file: no date, fixed ids, text as text.
    matplotlib.rcParams.update({"svg.hashsalt": "kvcsum", "svg.fonttype": "none", "font.size": 9})
    metadata = {"Date": None, "Creator": "scripts/bench-plots.py"}
    written = []
    colours = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3"]
    if cases:
        fig, ax = plt.subplots(figsize=(8, 0.45 * len(cases) * max(1, len(algorithms)) / 1.6 + 1.6))
        height = 0.8 / len(algorithms)
        for a, name in enumerate(algorithms):
            ys = [i + (a - (len(algorithms) - 1) / 2) * height for i in range(len(cases))]
            medians = [statistics.median(c.fractions[name]) for c in cases]
            low = [m - min(c.fractions[name]) for m, c in zip(medians, cases)]
            high = [max(c.fractions[name]) - m for m, c in zip(medians, cases)]
            ax.barh(ys, medians, height=height, color=colours[a % len(colours)], label=name,
                    xerr=[low, high] if runs > 1 else None, capsize=2)
            for y, m in zip(ys, medians):
                ax.text(m + 0.004, y, f"{m:.3f}", va="center", fontsize=7)
        ax.axvline(1.0, color="black", linewidth=1)
        ax.text(1.003, len(cases) - 0.5, "read ceiling", fontsize=8, rotation=90, va="bottom")
        ax.set_yticks(range(len(cases)))
        ax.set_yticklabels([c.label for c in cases])
        ax.invert_yaxis()
        lowest = min(min(c.fractions[name]) for c in cases for name in algorithms)
        ax.set_xlim(max(0.0, lowest - 0.1), 1.06)
        ax.set_xlabel("throughput as a fraction of the read ceiling measured in the same run")
        runs_text = "one run" if runs == 1 else f"median of {runs} runs, whiskers the range"
        ax.set_title(f"kvcsum device engine: {card}\n{date}, commit {commit} ({runs_text})", fontsize=9)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=len(algorithms), fontsize=8)
        fig.tight_layout()
        path = os.path.join(out, "gpu-throughput.svg")
        fig.savefig(path, metadata=metadata, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    if catalogue:
        cat_algorithms, classes, heading = catalogue
        fig, ax = plt.subplots(figsize=(8, 0.32 * len(classes) * max(1, len(cat_algorithms)) / 1.5 + 1.6))
        height = 0.8 / len(cat_algorithms)
        for a, name in enumerate(cat_algorithms):
            ys = [i + (a - (len(cat_algorithms) - 1) / 2) * height for i in range(len(classes))]
            rates = [missed[name] / trials for _, trials, missed in classes]
            ax.barh(ys, rates, height=height, color=colours[a % len(colours)], label=name)
            for y, (_, trials, missed) in zip(ys, classes):
                ax.text(missed[name] / trials + 0.01, y, f"{missed[name]}/{trials}", va="center", fontsize=6)
        ax.set_yticks(range(len(classes)))
        ax.set_yticklabels([c for c, _, _ in classes], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, 1.15)
        ax.set_xlabel("fraction of injected faults missed (engine and direct paths together)")
        seed = re.search(r"seed (\d+)", heading)
        ax.set_title("kvcsum fault catalogue (tests/it/fault_catalogue.rs)"
                     + (f"\nseed {seed.group(1)}" if seed else ""), fontsize=9)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.06), ncol=len(cat_algorithms), fontsize=8)
        fig.tight_layout()
        path = os.path.join(out, "fault-catalogue.svg")
        fig.savefig(path, metadata=metadata, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written


def run_facts(bench_path: str) -> dict[str, str]:
    facts = {}
    path = os.path.join(os.path.dirname(os.path.abspath(bench_path)), "run.txt")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as file:
            for line in file:
                key, _, value = line.partition(":")
                if value.strip():
                    facts[key.strip()] = value.strip()
    return facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bench", nargs="+", default=[], help="gpu_bench outputs, one per run")
    parser.add_argument("--catalogue", help="the fault catalogue's output")
    parser.add_argument("--card")
    parser.add_argument("--date")
    parser.add_argument("--commit")
    parser.add_argument("--out", default="docs/img")
    parser.add_argument("--update", metavar="BENCHMARKS.md", help="replace the table between the markers there")
    parser.add_argument("--table-only", action="store_true", help="no plots (no matplotlib needed)")
    args = parser.parse_args()
    if not args.bench and not args.catalogue:
        parser.error("nothing to do: give --bench, --catalogue or both")

    algorithms, cases, card = read_bench(args.bench) if args.bench else ([], [], None)
    facts = run_facts(args.bench[0]) if args.bench else {}
    card = args.card or facts.get("card") or card or "unknown card"
    date = args.date or facts.get("date", "unknown date")
    commit = args.commit or facts.get("commit", "unknown")
    catalogue = read_catalogue(args.catalogue) if args.catalogue else None

    if cases:
        table = bench_table(algorithms, cases, card, date, commit, len(args.bench))
        if args.update:
            with open(args.update, encoding="utf-8") as file:
                text = file.read()
            if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
                sys.exit(f"{args.update}: expected one `{BEGIN}` and, after it, one `{END}`")
            start = text.index(BEGIN) + len(BEGIN)
            text = text[:start] + "\n" + table + text[text.index(END) :]
            with open(args.update, "w", encoding="utf-8") as file:
                file.write(text)
            print(f"{args.update}: the GPU table, {len(cases)} cases x {len(algorithms)} algorithms")
        else:
            print(table)
    if not args.table_only:
        os.makedirs(args.out, exist_ok=True)
        for path in plots(args.out, algorithms, cases, card, date, commit, len(args.bench), catalogue):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
