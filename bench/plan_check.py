"""The trainer's memory planner (primerl_trainer.plan.trainer_memory) against every peak measured
on one H200 in bench/results: bench/model_step.py's "ours" rows (one GPU, no FSDP2: fp32 weights
under bf16 autocast and fused AdamW, or `:bf16` weights and SGD) and bench/trainer_step.py's rows
(FSDP2, `rows_per_gpu` micro-batch rows of `seq` tokens, `--ep/--cp/--ac`).

Prints one line per measured (shape, settings) used: file | model and settings | measured GiB |
predicted GiB | predicted / measured, then the worst ratio; exits 1 if any is outside
[0.9, 1.1]. Rows left out, and why, are listed after the table (LEFT_OUT: a file or a row the
current tree no longer measures the same way, a duplicate, a vision-language row).

    python bench/plan_check.py
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_step import our_args  # noqa: E402  (the benchmark shapes)
from primerl_trainer.plan import GIB, TrainerLayout, trainer_memory  # noqa: E402

RESULTS = Path(__file__).parent / "results"
LOW, HIGH = 0.9, 1.1

LEFT_OUT = {
    # whole files: an older tree whose step kept different tensors than today's
    "dense-before-fused-logprobs.json": "the tree before the fused chunked logprobs (e60fd87); the same rows "
    "measured since in qwen3-1.7b.json, qwen3-4b.json",
    "trainer-1gpu.json": "the 2026-11-30 tree (loss x world, averaged reductions); re-measured in "
    "2026-12-03-trainer-step-sum-reduction.json",
    "trainer-1gpu-first.json": "the same row as trainer-1gpu.json",
    "trainer-2gpu-first.json": "the same row as trainer-2gpu.json",
    "gpt-oss-20b-4l-2026-12-02.json": "before the lm_head gradient's fp32 GEMM accumulation and the fused "
    "gate-up (bb6bf79); re-measured in gpt-oss-20b-4l-2026-12-02-final.json",
    "gpt-oss-20b-4l-ours-2026-12-02-b.json": "the same tree as gpt-oss-20b-4l-2026-12-02.json",
    "qwen3-30b-a3b-6l-2026-12-01.json": "the same row as qwen3-30b-a3b-6l.json (68.69 GiB in every file)",
    "qwen3-30b-a3b-6l-2026-12-02.json": "the same row as qwen3-30b-a3b-6l.json (68.69 GiB in every file)",
    "qwen3-1.7b.json": "the 2026-11-30 tree (bf16 [V, D] product per logprob chunk); re-measured in "
    "qwen3-1.7b-lora-16k-2026-12-02.json (lora_rank 0)",
    "qwen3.5-0.8b-8k-2026-12-02.json": "Gated DeltaNet in the fp32 torch form (before fla's kernels)",
    "qwen3.5-0.8b-8k-2026-12-02-scan.json": "Gated DeltaNet in the fp32 torch form (before fla's kernels)",
    "qwen3.5-0.8b-16k-2026-12-02.json": "Gated DeltaNet in the fp32 torch form (before fla's kernels)",
    "qwen3.5-0.8b-16k-2026-12-02-scan.json": "Gated DeltaNet in the fp32 torch form (before fla's kernels)",
    "qwen3.5-q08-16k-2026-12-02.json": "Gated DeltaNet in the fp32 torch form (before fla's kernels)",
    "qwen3.5-q08-16k-tf32-2026-12-02.json": "Gated DeltaNet in the fp32 torch form (before fla's kernels)",
    "qwen3.5-q08-8k-2026-12-02.json": "Gated DeltaNet in the fp32 torch form (before fla's kernels)",
    "qwen3.5-q35-8k-2026-12-02.json": "Gated DeltaNet in the fp32 torch form (before fla's kernels); the only "
    "qwen3.5-35b-a3b-4l measurement",
    "qwen3.5-q08-16k-fla-2026-12-02.json": "fla's rule with the conv still the compiled fp32 torch form "
    "(gdn fla), or the whole fp32 torch form (gdn torch)",
    "qwen3.5-q08-16k-fla-logprobs-2026-12-03.json": "before the rule's states were kept for the backward "
    "(KEEP_STATES) and the custom ops; the current tree's row: qwen3.5-q08-16k-customops-2026-12-03.json",
    "qwen3.5-q08-16k-conv-keep-2026-12-03.json": "before KEEP_STATES and the custom ops (see customops)",
    "qwen3.5-q08-16k-keepstates-2026-12-03.json": "before the custom ops (see customops)",
    "qwen3.5-q08-16k-before-customops-keep-2026-12-03.json": "before the custom ops (see customops-keep)",
    "qwen3.5-0.8b-vl-2026-12-02.json": "vision-language rows: the vision tower's activations are not modelled",
    "qwen3.5-0.8b-vl-rerun-2026-12-02.json": "vision-language rows: the vision tower's activations are not modelled",
    "glm5-sparse-mla-16k-2026-12-05.json": "a kernel benchmark (sparse MLA alone), not a step",
    "glm5-sparse-mla-16k-split-2026-12-06.json": "a kernel benchmark (sparse MLA alone), not a step",
    "glm5-indexer-16k-h100-2026-12-06.json": "a kernel benchmark (the attention block and its indexer), not a step",
    "glm5-kernels-16k-h100-2026-12-06.json": "a kernel benchmark (the sparse MLA kernels alone), not a step",
}


@dataclass
class Measured:
    file: str
    model: str
    layers: int | None
    layout: TrainerLayout
    peak_gib: float
    note: str = ""

    @property
    def settings(self) -> str:
        lay = self.layout
        parts = [f"{self.model}" + (f" {self.layers}l" if self.layers else ""), f"T={lay.row_tokens}"]
        if lay.fsdp:
            parts += [f"fsdp W={lay.world} ep={lay.ep} cp={lay.cp} rows={lay.rows}"]
        else:
            parts += ["model_step"]
        if lay.activation_checkpointing:
            parts.append("ac")
        if lay.keep_logits:
            parts.append("keep_logits")
        if lay.lora_rank:
            parts.append(f"lora{lay.lora_rank}")
        if lay.states != "fp32+adamw":
            parts.append(lay.states)
        if not lay.compiled:
            parts.append("eager")
        return " ".join(parts)

    def predicted(self) -> float:
        return trainer_memory(our_args(self.model, self.layers), self.layout).peak / GIB


def _rows(data) -> list[dict]:
    if isinstance(data, list):
        return data
    if isinstance(data, dict) and "rows" in data:
        return data["rows"]
    return [data] if isinstance(data, dict) else []


def measured_rows(results: Path = RESULTS) -> tuple[list[Measured], list[tuple[str, str]]]:
    """(the measured rows used, [(file or row, why it was left out)])."""
    used: list[Measured] = []
    left: list[tuple[str, str]] = []
    seen: dict[tuple, Measured] = {}
    for path in sorted(results.glob("*.json")):
        try:
            rows = _rows(json.loads(path.read_text()))
        except json.JSONDecodeError:
            continue
        rows = [r for r in rows if "peak_gib" in r or r.get("oom")]
        if not rows:
            continue
        if path.name in LEFT_OUT:
            left.append((path.name, LEFT_OUT[path.name]))
            continue
        for r in rows:
            what = f"{path.name}: {r.get('model')} {r.get('impl', 'trainer_step')} seq {r.get('seq')}"
            if "model" not in r:
                left.append((what, "no model (not a step)"))
                continue
            if r.get("impl", "ours") != "ours":
                continue  # transformers' rows: not primerl's trainer
            if r.get("oom") or "peak_gib" not in r:
                left.append((what, "out of memory: no peak"))
                continue
            if r.get("overrides"):  # bench/model_step.py --set: not the shape our_args builds
                left.append((what, f"the shape's config changed by --set {r['overrides']}"))
                continue
            if str(r.get("tree", "after")).startswith("before"):
                left.append(
                    (what + f" ({r.get('file')})", "the tree before 0920262 (the same peaks as its 'after' rows)")
                )
                continue
            if "impl" in r:  # bench/model_step.py
                layout = TrainerLayout(
                    row_tokens=r["seq"],
                    activation_checkpointing=bool(r["ac"]),
                    keep_logits=bool(r.get("keep_logits")),
                    lora_rank=r.get("lora_rank") or None,
                    states="bf16+sgd" if r.get("weights") == "bf16 + SGD" else "fp32+adamw",
                    fsdp=False,
                    packed=r.get("docs", 1) > 1,
                    compiled=bool(r.get("compile", True)),
                )
                layers = None
            else:  # bench/trainer_step.py
                gpus = r["gpus"]
                layout = TrainerLayout(
                    world=gpus,
                    ep=r.get("ep", 1),
                    cp=r.get("cp", 1),
                    row_tokens=r["seq"],
                    rows=r["rows_per_gpu"],
                    activation_checkpointing=bool(r["ac"]),
                    packed=r.get("docs", 8) > 1,
                )
                layers = r.get("layers")
                if layers == our_args(r["model"]).num_layers:
                    layers = None
            m = Measured(path.name, r["model"], layers, layout, r["peak_gib"])
            key = (m.model, m.layers, m.layout)
            if key in seen:
                left.append((what + (f" ({r['file']})" if "file" in r else ""), f"a repeat of {seen[key].file}'s row"))
                continue
            seen[key] = m
            used.append(m)
    return used, left


def main() -> int:
    used, left = measured_rows()
    print("| file | model and settings | measured GiB | predicted GiB | ratio | phase |")
    print("|---|---|---|---|---|---|")
    worst = 1.0
    bad = 0
    for m in used:
        mem = trainer_memory(our_args(m.model, m.layers), m.layout)
        pred = mem.peak / GIB
        ratio = pred / m.peak_gib
        worst = ratio if abs(ratio - 1) > abs(worst - 1) else worst
        flag = "" if LOW <= ratio <= HIGH else "  <-- outside [0.9, 1.1]"
        bad += flag != ""
        print(f"| {m.file} | {m.settings} | {m.peak_gib:.2f} | {pred:.2f} | {ratio:.3f} | {mem.phase} |{flag}")
    print(f"\nworst ratio: {worst:.3f} over {len(used)} rows; {bad} outside [{LOW}, {HIGH}]")
    print("\nleft out:")
    for what, why in left:
        print(f"- {what}: {why}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
