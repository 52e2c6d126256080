"""The layer benchmark of two builds, side by side: per (shape, path, tokens), the range of the
per-rank medians of each build over its rounds, their median, and the change of that median.

    python3 tools/ab_table.py LOG [LOG ...]
    python3 tools/ab_table.py --self-test     # no GPU: made-up logs through the table (ctest)

Each LOG is the output of one `epmoe-bench layer` run; its file name says which build and round
ran it: ..._new_... or ..._old_... (as tools/gpu_all.sh ab-ranks names them); other files are
skipped. The shape comes from the log's first line. Why a range over ranks and rounds rather than
one number: at R >= 2 the ranks of one call differ by their share of the routing, and rounds by the
clock; a change smaller than the ranges' spread is not a change.
"""

from __future__ import annotations

import re
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

_ROW = re.compile(r"^\s*(\d+)\s+(pipeline|fused)\s+(\d+)\s+([0-9.]+)\s")
_SHAPE = re.compile(r"shape (\S+) \(")
_BUILDS = ("old", "new")


def parse(path: Path) -> tuple[str, list[tuple[str, int, float]]]:
    """(shape, [(path, tokens, median_us), ...]) of one benchmark log."""
    shape, rows = "?", []
    for line in path.read_text(errors="replace").splitlines():
        m = _SHAPE.search(line)
        if m and shape == "?":
            shape = m.group(1)
        m = _ROW.match(line)
        if m:
            rows.append((m.group(2), int(m.group(3)), float(m.group(4))))
    return shape, rows


def build_of(path: Path) -> str | None:
    for b in _BUILDS:
        if f"_{b}_" in path.name or path.name.startswith(f"{b}_"):
            return b
    return None


def summarize(paths: list[Path]) -> dict[tuple[str, str, int], dict[str, tuple[float, float, float]]]:
    """(shape, path, tokens) -> build -> (min, max, median) of the per-rank medians."""
    seen: dict[tuple[str, str, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for p in paths:
        b = build_of(p)
        if b is None:
            continue
        shape, rows = parse(p)
        for path, tokens, us in rows:
            seen[(shape, path, tokens)][b].append(us)
    return {k: {b: (min(xs), max(xs), statistics.median(xs)) for b, xs in v.items()} for k, v in seen.items()}


def table(paths: list[Path]) -> str:
    s = summarize(paths)
    out = [f"{'shape':<10} {'path':<9} {'tokens':>6} | {'old: range (median), us':>26} | "
           f"{'new: range (median), us':>26} | {'change':>8}"]
    for key in sorted(s):
        v = s[key]
        cells = [f"{v[b][0]:8.1f}-{v[b][1]:<8.1f}({v[b][2]:7.1f})" if b in v else f"{'-':>26}" for b in _BUILDS]
        change = f"{v['new'][2] - v['old'][2]:+.1f}" if len(v) == 2 else "-"
        out.append(f"{key[0]:<10} {key[1]:<9} {key[2]:>6} | {cells[0]} | {cells[1]} | {change:>8}")
    return "\n".join(out)


def self_test() -> int:
    """Made-up logs of both builds (and one of neither): every (shape, path, tokens) once, each
    build's range and median from every rank and round, and only the named files counted."""

    def log(shape: str, rows: list[tuple[int, str, int, float]]) -> str:
        head = f"epmoe-bench layer: shape {shape} (E/rank 32, H 7168, I 2048, K 8), fp8\n"
        head += "  rank  path      tokens  median_us    p10_us\n"
        return head + "".join(f"     {r}  {p:<8} {t:>6} {us:10.1f} {us:9.1f}\n" for r, p, t, us in rows)

    files = {
        "x_new_1.log": log("dsv3", [(0, "fused", 1, 100.0), (1, "fused", 1, 102.0), (0, "pipeline", 1, 110.0)]),
        "x_old_1.log": log("dsv3", [(0, "fused", 1, 104.0), (1, "fused", 1, 106.0), (0, "pipeline", 1, 111.0)]),
        "x_new_2.log": log("dsv3", [(0, "fused", 1, 101.0), (1, "fused", 1, 103.0)]),
        "x_old_2.log": log("qwen3", [(0, "fused", 8, 50.0)]),
        "unrelated.log": log("dsv3", [(0, "fused", 1, 1.0)]),
    }
    with tempfile.TemporaryDirectory() as d:
        for name, text in files.items():
            (Path(d) / name).write_text(text)
        paths = sorted(Path(d).iterdir())
        got = summarize(paths)
        lines = table(paths).splitlines()
    want = {
        ("dsv3", "fused", 1): {"new": (100.0, 103.0, 101.5), "old": (104.0, 106.0, 105.0)},
        ("dsv3", "pipeline", 1): {"new": (110.0, 110.0, 110.0), "old": (111.0, 111.0, 111.0)},
        ("qwen3", "fused", 8): {"old": (50.0, 50.0, 50.0)},
    }
    ok = got == want and len(lines) == 4 and lines[1].endswith("-3.5") and lines[3].endswith(" -")
    print("ab_table self-test " + ("passed" if ok else f"FAILED:\n{got}\n" + "\n".join(lines)))
    return 0 if ok else 1


def main(argv: list[str]) -> int:
    if argv == ["--self-test"]:
        return self_test()
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    print(table([Path(a) for a in argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
