#!/usr/bin/env python3
"""Where a kernel's time goes, from an Nsight Compute SASS source-page export.

    ncu -i REPORT --page source --csv --print-source sass > sass.csv
    python3 bench/gpu/ncu_hot_lines.py sass.csv [--top 12]

Prints the warp-stall reasons' shares of all samples, the shared-memory wavefronts against
their ideal (bank conflicts), and the opcodes with the most stall samples (instructions
executed, shared wavefronts). Columns are found by name, so other ncu versions' extra
columns do not matter.
"""
import argparse
import csv
import sys


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    with open(args.csv, newline="") as f:
        rows = list(csv.reader(f))
    start = next((i for i, r in enumerate(rows) if "Source" in r and "Address" in r), None)
    if start is None:
        sys.exit("no SASS table in " + args.csv)
    header = rows[start]
    body = [r for r in rows[start + 1:] if len(r) == len(header)]
    col = {name: i for i, name in enumerate(header)}
    samples = col.get("Warp Stall Sampling (All Samples)")
    if samples is None:
        sys.exit("no stall samples in " + args.csv)
    total = sum(number(r[samples]) for r in body) or 1.0
    reasons = [n for n in header if n.startswith("stall_") and "Not Issued" not in n]
    shares = sorted(((sum(number(r[col[n]]) for r in body) / total, n[6:]) for n in reasons),
                    reverse=True)
    print("stalls: " + ", ".join(f"{name} {share * 100:.1f}%" for share, name in shares[:8]))
    wave, ideal = col.get("L1 Wavefronts Shared"), col.get("L1 Wavefronts Shared Ideal")
    if wave is not None and ideal is not None:
        w = sum(number(r[wave]) for r in body)
        i = sum(number(r[ideal]) for r in body)
        print(f"shared wavefronts {w:.3g} (ideal {i:.3g})")
    executed = col.get("Instructions Executed")
    by_op = {}
    for r in body:
        words = r[col["Source"]].split()
        if words and words[0].startswith("@"):
            words = words[1:]
        op = words[0].split(".")[0] if words else "?"
        entry = by_op.setdefault(op, [0.0, 0.0, 0.0])
        entry[0] += number(r[samples])
        entry[1] += number(r[executed]) if executed is not None else 0
        entry[2] += number(r[wave]) if wave is not None else 0
    print(f"{'opcode':10} {'stall%':>7} {'executed':>12} {'smem wf':>12}")
    for op, (s, e, w) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{op:10} {s / total * 100:7.1f} {e:12.0f} {w:12.0f}")


if __name__ == "__main__":
    main()
