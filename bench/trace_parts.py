"""Where one step's GPU time goes, by part of the step: optimizer, output projection, attention,
expert GEMMs, other GEMMs, casts, routing, the rest.

Reads the (gzipped) Chrome trace of one profiled step (bench/model_step.py --profile --trace)
and sums each GPU event's time into the first part whose rule matches it: the host ops around
its launch (the optimizer's step, the chunked logprobs' forward or backward) first, then its
kernel's name. Kernel names are heuristics (inductor names its fused kernels after the ops in
them): the table says which names fell where with --names.

    python bench/trace_parts.py trace.json.gz [--names 4]
"""

from __future__ import annotations

import argparse
import collections

from trace_gaps import GPU_CATS, host_chain, host_index, load

# (part, where to look, any of these substrings); first match wins
RULES = [
    ("optimizer (fused AdamW)", "host", ("Optimizer.step",)),
    ("optimizer (fused AdamW)", "kernel", ("multi_tensor_apply",)),
    ("lm_head + logprobs, backward", "host", ("_ChunkedLogprobsBackward",)),
    ("lm_head + logprobs, forward", "host", ("_ChunkedLogprobs",)),
    ("attention", "kernel", ("sdpa", "flex_attention", "fmha", "flash", "cudnn")),
    ("expert GEMMs (grouped)", "kernel", ("GemmUniversal",)),
    ("other GEMMs (q/k/v/o, router, shared expert)", "kernel", ("nvjet", "gemm", "cutlass")),
    ("routing, sorting, moving rows", "kernel", ("index", "sort", "topk", "TopK", "scatter", "gather")),
    ("casts and copies (to_copy)", "kernel", ("_to_copy", "copy_kernel")),
    ("memset / memcpy", "cat", ("gpu_memset", "gpu_memcpy")),
]
REST = "norms, RoPE, activations, other"


def part_of(event: dict, chain: str) -> str:
    for part, where, needles in RULES:
        text = {"host": chain, "kernel": event["name"], "cat": event.get("cat", "")}[where]
        if any(n in text for n in needles):
            return part
    return REST


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("trace")
    parser.add_argument("--names", type=int, default=0, help="list this many kernel names per part")
    args = parser.parse_args()
    events = load(args.trace)
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    if not gpu:
        raise SystemExit(f"{args.trace}: no GPU events (a trace of a CPU run?)")
    _, ops_by_tid, launches = host_index(events)
    time: collections.Counter = collections.Counter()
    names: dict = collections.defaultdict(collections.Counter)
    for e in gpu:
        launch = launches.get(e.get("args", {}).get("correlation"))
        chain = host_chain(ops_by_tid, launch["tid"], launch["ts"], depth=50) if launch else ""
        part = part_of(e, chain)
        time[part] += e["dur"]
        names[part][e["name"][:80]] += e["dur"]
    total = sum(time.values())
    print(f"GPU busy {total / 1e3:.1f} ms ({len(gpu)} events)\n")
    print("| part | ms | share |\n|---|---|---|")
    for part, t in time.most_common():
        print(f"| {part} | {t / 1e3:.1f} | {t / total:.1%} |")
    for part, t in time.most_common():
        for name, tn in names[part].most_common(args.names):
            print(f"    {part[:30]:<30} {tn / 1e3:7.2f} ms  {name}")


if __name__ == "__main__":
    main()
