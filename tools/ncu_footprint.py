#!/usr/bin/env python3
"""The code a kernel launch ran, by source file: ncu's per-instruction SASS CSV joined with a
line-info disassembly of the same kernel.

Why: a megakernel decode call runs most of its code once per SM per call, and code past the SM's
instruction cache capacity (~128 KB, epmoe-icache-probe) comes from L2 again every call
(docs/DESIGN.md, "Instruction fetch in decode"). This prints how much distinct code the launch
ran, how much of it every block ran, and where ncu's "no instruction" stall samples fell.

Usage (here, no GPU needed, after a GPU run exported the CSV):
  nvcc <the library's flags> -lineinfo -cubin src/device/kernels/sm90_fused_fp8.cu -o /tmp/k.cubin
  nvdisasm -g -c /tmp/k.cubin > /tmp/k.sass
  python3 tools/ncu_footprint.py CSV /tmp/k.sass --kernel ILb1ELb0E [--blocks 132] [--top 25]

CSV: `ncu --import R.ncu-rep --page source --print-source sass --csv` of one kernel (the
Instructions Executed and stall_* columns need --section SourceCounters). The disassembly must
come from a build with the same flags as the profiled binary (EPMOE_TEST_HOOKS included): the
script checks that the two instruction sequences match opcode for opcode.
"""
import argparse
import collections
import csv
import re
import sys


def read_listing(path, kernel):
    """(file, line) and opcode text of each instruction of the first function matching `kernel`."""
    out, cur, inside = [], None, False
    for line in open(path):
        if line.startswith(".text."):
            if inside:
                break
            inside = kernel in line
            continue
        if not inside:
            continue
        m = re.match(r'\s*//## File "([^"]+)", line (\d+)', line)
        if m:
            cur = (re.sub(r"^.*?/src/", "", m.group(1)), int(m.group(2)))
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            out.append((cur, m.group(2)))
    return out


def opcode(text):
    parts = text.split()
    return parts[1] if parts and parts[0].startswith("@") and len(parts) > 1 else (parts[0] if parts else "")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("listing")
    ap.add_argument("--kernel", required=True, help="a substring of the mangled kernel name")
    ap.add_argument("--blocks", type=int, default=132, help="executions that count as 'every block'")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()

    rows = list(csv.reader(open(a.csv)))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    hdr, data = rows[head], rows[head + 1 :]
    col = {h: i for i, h in enumerate(hdr)}
    executed, samples = col["Instructions Executed"], col["Warp Stall Sampling (All Samples)"]
    no_inst = col.get("stall_no_inst")
    listing = read_listing(a.listing, a.kernel)
    if len(listing) != len(data) or any(opcode(s) != opcode(r[1]) for (_, s), r in zip(listing, data)):
        sys.exit(f"ncu_footprint: the listing ({len(listing)} instructions) is not the profiled kernel "
                 f"({len(data)}): build it with the profiled binary's flags")

    ran = collections.Counter()
    every = collections.Counter()
    stalls = collections.Counter()
    fetch = collections.Counter()
    lines_ran, lines_every = set(), set()
    for ((src, _), r) in zip(listing, data):
        f = src[0] if src else "?"
        n = int(r[executed] or 0)
        addr_line = int(r[0], 16) // 128
        if n > 0:
            ran[f] += 1
            lines_ran.add(addr_line)
        if n >= a.blocks:
            every[f] += 1
            lines_every.add(addr_line)
        stalls[f] += int(r[samples] or 0)
        if no_inst is not None:
            fetch[f] += int(r[no_inst] or 0)
    total = sum(ran.values())
    print(f"{len(data)} instructions; ran {total} ({total * 16 / 1024:.1f} KB, {len(lines_ran) * 128 / 1024:.1f} KB "
          f"of 128-byte lines); every block ({a.blocks}+ executions): {sum(every.values())} "
          f"({len(lines_every) * 128 / 1024:.1f} KB of lines)")
    all_samples, all_fetch = sum(stalls.values()), sum(fetch.values())
    if all_samples:
        print(f"stall samples {all_samples}, 'no instruction' {all_fetch} ({100 * all_fetch / all_samples:.1f}%)")
    print(f"{'ran':>6} {'KB':>6} {'every':>6} {'no_inst':>8} {'samples':>8}  file")
    for f, n in ran.most_common(a.top):
        print(f"{n:6d} {n * 16 / 1024:6.1f} {every[f]:6d} {fetch[f]:8d} {stalls[f]:8d}  {f}")


if __name__ == "__main__":
    main()
