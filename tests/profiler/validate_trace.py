#!/usr/bin/env python3
"""Validates a Chrome trace (Trace Event Format, JSON object form) as the
importers of chrome://tracing and Perfetto read it, independently of kiln's
C++ reader: a second parser (Python's json, strict) and the format's rules.

No headless Trace Event validator is packaged for this machine: Debian has
none (node-chrome-trace-event only writes traces); on npm, chrome-trace-event
and trace-event-lib write traces, @clinic/trace-events-parser reads Node's own
streams, and @tracerbench/trace-model (tried: a model builder) throws on
nothing and skips every event of pid 0; the Perfetto UI and trace_processor
are downloads. So this script is the external check the profiler tests run on
every trace they write.

  validate_trace.py TRACE.json [--expect-flows N] [--expect-pids N]
Exit 0 and a one-line summary when valid; exit 1 with one line per problem.
"""
import json
import math
import sys

PHASES = set("BEXiIMCsftbenSTpFOPNDR") | {"(", ")"}
METADATA = {"process_name", "process_labels", "process_sort_index", "thread_name", "thread_sort_index"}


def num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def reject_constant(name):
    raise ValueError(f"non-standard JSON constant {name}")


def validate(path, expect_flows=None, expect_pids=None):
    errors = []
    with open(path, "rb") as f:
        raw = f.read()
    try:
        doc = json.loads(raw.decode("utf-8"), parse_constant=reject_constant)
    except (UnicodeDecodeError, ValueError) as e:
        return [f"{path}: not valid JSON: {e}"], {}
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        return [f"{path}: expected an object with a traceEvents array"], {}
    if doc.get("displayTimeUnit", "ms") not in ("ms", "ns"):
        errors.append(f"displayTimeUnit must be 'ms' or 'ns', got {doc.get('displayTimeUnit')!r}")
    events = doc["traceEvents"]
    slices = {}  # (pid, tid) -> [(ts, end, name)]
    named_threads, named_procs = set(), set()
    flows = {}  # id -> {"s": [...], "f": [...]}
    counters = 0
    for i, e in enumerate(events):
        where = f"event {i}"
        if not isinstance(e, dict):
            errors.append(f"{where}: not an object")
            continue
        ph = e.get("ph")
        if not isinstance(ph, str) or ph not in PHASES:
            errors.append(f"{where}: unknown ph {ph!r}")
            continue
        for key in ("ts", "pid", "tid"):
            if key not in e:
                errors.append(f"{where} ({ph}): no {key}")
        if "ts" in e and not num(e["ts"]):
            errors.append(f"{where}: ts {e['ts']!r} is not a finite number")
        if not isinstance(e.get("pid"), int) or not isinstance(e.get("tid"), int):
            errors.append(f"{where}: pid and tid must be integers")
            continue
        if not isinstance(e.get("name", ""), str):
            errors.append(f"{where}: name is not a string")
        key = (e["pid"], e["tid"])
        if ph == "M":
            if e.get("name") not in METADATA:
                errors.append(f"{where}: unknown metadata name {e.get('name')!r}")
            args = e.get("args")
            if not isinstance(args, dict):
                errors.append(f"{where}: metadata without args")
            elif e["name"] == "thread_name":
                if isinstance(args.get("name"), str) and args["name"]:
                    named_threads.add(key)
                else:
                    errors.append(f"{where}: thread_name without a name")
            elif e["name"] == "process_name":
                if isinstance(args.get("name"), str) and args["name"]:
                    named_procs.add(e["pid"])
                else:
                    errors.append(f"{where}: process_name without a name")
        elif ph == "X":
            if not num(e.get("dur")) or e["dur"] < 0:
                errors.append(f"{where}: X event needs dur >= 0, got {e.get('dur')!r}")
                continue
            if not isinstance(e.get("name"), str) or not e["name"]:
                errors.append(f"{where}: X event without a name")
            if "args" in e and not isinstance(e["args"], dict):
                errors.append(f"{where}: args is not an object")
            if num(e.get("ts")):
                slices.setdefault(key, []).append((e["ts"], e["ts"] + e["dur"], e.get("name"), i))
        elif ph in ("s", "t", "f"):
            if "id" not in e:
                errors.append(f"{where}: flow event without id")
                continue
            if ph == "f" and e.get("bp") not in (None, "e"):
                errors.append(f"{where}: flow end with bp {e.get('bp')!r}")
            flows.setdefault(json.dumps(e["id"]), {"s": [], "t": [], "f": []})[ph].append(e)
        elif ph == "C":
            counters += 1
            args = e.get("args")
            if not isinstance(args, dict) or not args or not all(num(v) for v in args.values()):
                errors.append(f"{where}: counter without numeric args")

    # Per track: begins in file order are monotone, and slices nest or follow (no partial overlap).
    eps = 0.0015  # the three decimals of ns precision, and one rounding
    for key, lst in slices.items():
        prev = -math.inf
        for ts, end, name, i in lst:
            if ts + eps < prev:
                errors.append(f"track {key}: event {i} ({name}) begins at {ts} before the previous begin {prev}")
            prev = ts
        stack = []
        for ts, end, name, i in sorted(lst, key=lambda s: (s[0], -(s[1] - s[0]))):
            while stack and stack[-1][1] <= ts + eps:
                stack.pop()
            if stack and end > stack[-1][1] + eps:
                errors.append(f"track {key}: event {i} ({name}) overlaps {stack[-1][2]} without nesting")
            stack.append((ts, end, name))
        if key not in named_threads:
            errors.append(f"track {key}: no thread_name metadata")
    pids = {k[0] for k in slices}
    for pid in pids - named_procs:
        errors.append(f"pid {pid}: no process_name metadata")

    def binds(e, enclosing):
        for ts, end, name, _ in slices.get((e.get("pid"), e.get("tid")), []):
            if ts - 0.0015 <= e["ts"] <= end + 0.0015:
                return True
        return False

    for fid, ends in flows.items():
        if len(ends["s"]) != 1 or len(ends["f"]) != 1:
            errors.append(f"flow {fid}: expected one start and one finish, got {len(ends['s'])} and {len(ends['f'])}")
            continue
        s, f = ends["s"][0], ends["f"][0]
        if not binds(s, True):
            errors.append(f"flow {fid}: its start binds to no slice on pid {s['pid']} tid {s['tid']}")
        if not binds(f, True):
            errors.append(f"flow {fid}: its finish binds to no slice on pid {f['pid']} tid {f['tid']}")
        if num(s.get("ts")) and num(f.get("ts")) and f["ts"] < s["ts"]:
            errors.append(f"flow {fid}: finishes before it starts")
    if expect_flows is not None and len(flows) != expect_flows:
        errors.append(f"expected {expect_flows} flows, got {len(flows)}")
    if expect_pids is not None and len(pids) != expect_pids:
        errors.append(f"expected {expect_pids} processes with slices, got {len(pids)}")
    summary = {"events": len(events), "slices": sum(len(v) for v in slices.values()), "tracks": len(slices),
               "flows": len(flows), "counters": counters, "pids": len(pids)}
    return errors, summary


def main(argv):
    if not argv:
        print(__doc__)
        return 2
    path, expect_flows, expect_pids = argv[0], None, None
    rest = argv[1:]
    while rest:
        if rest[0] == "--expect-flows" and len(rest) > 1:
            expect_flows = int(rest[1])
        elif rest[0] == "--expect-pids" and len(rest) > 1:
            expect_pids = int(rest[1])
        else:
            print(f"validate_trace: unknown argument {rest[0]!r}")
            return 2
        rest = rest[2:]
    errors, summary = validate(path, expect_flows, expect_pids)
    for e in errors[:50]:
        print(e)
    if errors:
        print(f"validate_trace: {len(errors)} problem(s) in {path}")
        return 1
    print("validate_trace: ok " + " ".join(f"{k}={v}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
