"""Where the GPU waits: the idle gaps of one profiled step and what the host was doing then.

Reads a (gzipped) Chrome trace of host and GPU activity (bench/model_step.py --profile --trace)
and prints: the step's span, the GPU's busy time, its idle time split into the lead (step start to
first kernel), the gaps between kernels and the tail; then the gaps grouped by what the host ran
when it launched the kernel that ended each gap (the innermost host ops around that launch), and
the longest single gaps. A gap whose next kernel was launched after the gap began is the host's
doing (launch-bound code or a sync before it); one whose kernel was already queued is the GPU's
own (dependencies, a memcpy).

    python bench/trace_gaps.py trace.json.gz [--min-us 5] [--top 25] [--depth 3]
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ")


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def host_chain(ops_by_tid: dict, tid, t: float, depth: int) -> str:
    """The innermost `depth` host ops on thread `tid` that contain time t, outermost first."""
    starts, ops = ops_by_tid.get(tid, ([], []))
    i = bisect.bisect_right(starts, t)
    inside = [op for op in ops[max(0, i - 4000) : i] if op["ts"] + op["dur"] >= t]
    names = [op["name"] for op in sorted(inside, key=lambda op: (op["ts"], -op["dur"]))]
    return " > ".join(names[-depth:]) if names else "(no host op)"


def host_index(events: list[dict]):
    """(host ops, {tid: (starts, ops sorted by start)} for host_chain, {correlation: the host's
    launch call}) of a trace's events."""
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function")]
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    ops_by_tid: dict = collections.defaultdict(list)
    for e in host:
        ops_by_tid[e["tid"]].append(e)
    ops_by_tid = {
        tid: ([op["ts"] for op in ops], ops)
        for tid, ops in ((tid, sorted(ops, key=lambda op: op["ts"])) for tid, ops in ops_by_tid.items())
    }
    return host, ops_by_tid, launches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("trace")
    parser.add_argument("--min-us", type=float, default=5.0, help="smaller idle intervals are not gaps")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--depth", type=int, default=3, help="host ops named per gap, innermost last")
    args = parser.parse_args()

    events = load(args.trace)
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    if not gpu:
        raise SystemExit(f"{args.trace}: no GPU events (a trace of a CPU run?)")
    host, ops_by_tid, launches = host_index(events)

    step_start = min(e["ts"] for e in host) if host else gpu[0]["ts"]
    busy, end, gaps = 0.0, gpu[0]["ts"], []
    for e in gpu:
        if e["ts"] - end > args.min_us:
            gaps.append((end, e))
        busy += max(0.0, e["ts"] + e["dur"] - max(end, e["ts"]))
        end = max(end, e["ts"] + e["dur"])
    span = end - step_start
    lead = gpu[0]["ts"] - step_start
    idle = sum(e["ts"] - start for start, e in gaps)
    print(
        f"step {span / 1e3:.2f} ms: GPU busy {busy / 1e3:.2f} ms, lead {lead / 1e3:.2f} ms, "
        f"{len(gaps)} gaps of > {args.min_us:g} us {idle / 1e3:.2f} ms, "
        f"kernels {len(gpu)}"
    )

    by_cause: dict = collections.defaultdict(lambda: [0.0, 0, 0.0])
    rows = []
    for start, e in gaps:
        length = e["ts"] - start
        launch = launches.get(e.get("args", {}).get("correlation"))
        if launch is None:
            cause, host_late = "(launch not in trace)", float("nan")
        else:
            cause = host_chain(ops_by_tid, launch["tid"], launch["ts"], args.depth)
            host_late = launch["ts"] - start  # > 0: the kernel was launched after the GPU ran dry
        entry = by_cause[cause]
        entry[0] += length
        entry[1] += 1
        entry[2] += min(length, max(host_late, 0.0)) if host_late == host_late else 0.0
        rows.append((length, host_late, cause, e["name"]))
    syncs = [e for e in events if e.get("cat") == "cuda_runtime" and e["name"].startswith(SYNC_CALLS)]
    print(f"host syncs: {len(syncs)}, {sum(e['dur'] for e in syncs) / 1e3:.2f} ms waiting")

    print(f"\ngaps by the host ops that launched the next kernel (of {idle / 1e3:.2f} ms)")
    print(f"{'ms':>7} {'n':>5} {'host-late ms':>12}  host ops (innermost last)")
    for cause, (total, n, late) in sorted(by_cause.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"{total / 1e3:>7.2f} {n:>5} {late / 1e3:>12.2f}  {cause[:150]}")
    print("\nlongest gaps")
    print(f"{'us':>8} {'host-late us':>12}  next kernel  <-  host ops")
    for length, late, cause, kernel in sorted(rows, key=lambda r: -r[0])[: args.top]:
        print(f"{length:>8.0f} {late:>12.0f}  {kernel[:50]}  <-  {cause[:110]}")


if __name__ == "__main__":
    main()
