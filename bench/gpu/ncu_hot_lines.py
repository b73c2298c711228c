#!/usr/bin/env python3
"""The hottest source lines of an Nsight Compute source-page export.

    ncu -i REPORT --page source --csv --print-source cuda > source.csv
    python3 bench/gpu/ncu_hot_lines.py source.csv [--top 30]

Prints, for the lines with the most warp-stall samples, their share of all samples and of the
shared-memory wavefronts (the columns are found by name, so that other ncu versions' extra
columns do not matter), with the source text.
"""
import argparse
import csv
import sys


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def find(header, *words):
    for i, name in enumerate(header):
        if all(w.lower() in name.lower() for w in words):
            return i
    return None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    with open(args.csv, newline="") as f:
        rows = list(csv.reader(f))
    start = next((i for i, r in enumerate(rows) if find(r, "source") is not None and len(r) > 3),
                 None)
    if start is None:
        sys.exit("no source table in " + args.csv)
    header, body = rows[start], rows[start + 1:]
    col_line = find(header, "line")
    col_src = find(header, "source")
    col_stall = find(header, "stall sampling", "all")
    col_wave = find(header, "wavefronts shared") or find(header, "shared", "wavefront")
    col_inst = find(header, "instructions executed")
    total_stall = sum(number(r[col_stall]) for r in body if col_stall is not None and
                      len(r) > col_stall) or 1.0
    total_wave = sum(number(r[col_wave]) for r in body if col_wave is not None and
                     len(r) > col_wave) or 1.0
    print(f"columns: stall={header[col_stall] if col_stall is not None else '-'}, "
          f"wavefronts={header[col_wave] if col_wave is not None else '-'}")
    key = col_stall if col_stall is not None else col_wave
    body = [r for r in body if len(r) > max(c for c in (key, col_src) if c is not None)]
    body.sort(key=lambda r: -number(r[key]))
    print(f"{'line':>5} {'stall%':>7} {'smem%':>7} {'inst':>10}  source")
    for r in body[:args.top]:
        stall = number(r[col_stall]) / total_stall * 100 if col_stall is not None else 0
        wave = number(r[col_wave]) / total_wave * 100 if col_wave is not None else 0
        inst = r[col_inst] if col_inst is not None else ""
        line = r[col_line] if col_line is not None else ""
        print(f"{line:>5} {stall:7.2f} {wave:7.2f} {inst:>10}  {r[col_src].strip()[:100]}")


if __name__ == "__main__":
    main()
