#!/usr/bin/env python3
"""Prints one step of a Strata trace (`strata bench step --trace FILE`, `strata train --trace FILE`) as text:
every event between the start of step N and the end of step N+1's first forward, in time order, with its
thread, start and end in ms from the step's start, and its argument (a sub-group, a unit or a byte count).

    scripts/trace_text.py run.json --step 5
"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--step", type=int, default=None, help="the step's argument (default: the middle step)")
    ap.add_argument("--min-ms", type=float, default=0.0, help="leave out spans shorter than this")
    a = ap.parse_args()
    with open(a.trace) as f:
        events = json.load(f)["traceEvents"]
    threads = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    steps = sorted((e for e in events if e["ph"] == "X" and e["name"] == "step"), key=lambda e: e["ts"])
    if not steps:
        sys.exit(f"{a.trace}: no 'step' spans")
    if a.step is None:
        step = steps[len(steps) // 2]
    else:
        found = [e for e in steps if e.get("args", {}).get("arg") == a.step]
        if not found:
            sys.exit(f"{a.trace}: no step {a.step} (steps {[e['args']['arg'] for e in steps]})")
        step = found[0]
    t0 = step["ts"]
    later = [e for e in steps if e["ts"] > t0]
    # Through the next step's first forward: that is where the update overlapping it ends.
    t1 = step["ts"] + step["dur"]
    if later:
        fwd = [e for e in events if e["ph"] == "X" and e["name"] == "forward" and e["ts"] >= later[0]["ts"]]
        if fwd:
            first = min(fwd, key=lambda e: e["ts"])
            t1 = first["ts"] + first["dur"]
    begins = {}
    rows = []
    for e in events:
        if e["ph"] == "b":
            begins[e["id"]] = e
            continue
        if e["ph"] == "e":
            b = begins.pop(e["id"], None)
            if b is None:
                continue
            start, end, name, arg = b["ts"], e["ts"], b["name"], b.get("args", {}).get("arg")
            thread = "(async)"
        elif e["ph"] in ("X", "i"):
            start, end, name, arg = e["ts"], e["ts"] + e.get("dur", 0), e["name"], e.get("args", {}).get("arg")
            thread = threads.get(e["tid"], str(e["tid"]))
        else:
            continue
        if end < t0 or start > t1 or (e["ph"] == "X" and (end - start) / 1e3 < a.min_ms):
            continue
        rows.append((start, end, thread, name, arg))
    rows.sort()
    width = max(len(r[2]) for r in rows) if rows else 8
    print(f"step {step['args']['arg']}: {step['dur'] / 1e3:.1f} ms; times in ms from its start")
    for start, end, thread, name, arg in rows:
        extra = "" if arg is None else f" [{arg}]"
        print(f"{(start - t0) / 1e3:9.2f} {(end - t0) / 1e3:9.2f} {(end - start) / 1e3:8.2f}  {thread:<{width}}  "
              f"{name}{extra}")


if __name__ == "__main__":
    main()
