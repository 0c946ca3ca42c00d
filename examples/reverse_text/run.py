"""The reverse-text example: a tiny Qwen3 learns to write strings backwards, first from
examples (SFT), then from its own samples and a reward (RL). Runs on a CPU in minutes.

    uv run python examples/reverse_text/run.py                       # runs/reverse_text
    uv run python examples/reverse_text/run.py --run-dir runs/rt2 --model path/to/hf_model
    uv run python examples/reverse_text/run.py rl.max_steps=200 sft.max_steps=80

Stages, each a primerl command on a config beside this file:
1. without `--model`, build a tiny Qwen3 (hidden 128, 4 layers, 4 heads, one token per
   character) with random weights in RUN_DIR/base;
2. write SFT data, strings of the same kind the environment draws (another seed), each with its
   reversal, to RUN_DIR/sft_data.jsonl;
3. `primerl sft @ sft.toml` -> RUN_DIR/sft (a partly trained model: it reverses some strings);
4. `primerl rl @ rl.toml` on the reverse-text environment from the SFT model -> RUN_DIR/rl;
5. `primerl report RUN_DIR/rl` (plots and summary.txt), then the wall time of each stage.

Trailing `sft.KEY=VALUE` / `rl.KEY=VALUE` arguments override keys of the two configs. Rerunning
resumes: finished stages are skipped, an interrupted RL run continues from its last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import random
import string
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
ALPHABET = string.ascii_lowercase


def build_model(folder: Path) -> Path:
    from primerl_models.tiny import build_tiny_model

    if not (folder / "config.json").exists():
        build_tiny_model(
            folder,
            "qwen3",
            alphabet=ALPHABET,
            hidden_size=128,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            head_dim=64,
            seed=0,
        )
    return folder


def write_sft_data(path: Path, rows: int, seed: int = 1234) -> Path:
    """Random lowercase strings of 4-8 characters (the environment's defaults) and their reversals."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(rows):
            text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(4, 8)))
            f.write(json.dumps({"prompt": text, "completion": text[::-1]}) + "\n")
    return path


def run(argv: list[str], log: Path | None = None, on_line=None) -> None:
    """Run a primerl command, echoing its output; exits with its code when it fails."""
    print("$", " ".join(argv), flush=True)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    with open(log, "a") if log else open("/dev/null", "w") as out:
        for line in proc.stdout:
            print(line, end="", flush=True)
            out.write(line)
            if on_line:
                on_line(line)
    if proc.wait() != 0:
        sys.exit(f"reverse_text: {Path(argv[0]).name} {argv[1]} failed with exit code {proc.returncode}")


def final_weights(sft_dir: Path) -> Path | None:
    steps = sorted(
        (p for p in (sft_dir / "weights").glob("step_*") if (p / "primerl.json").exists()),
        key=lambda p: int(p.name.split("_")[1]),
    )
    return steps[-1] if steps else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", default="runs/reverse_text", type=Path)
    parser.add_argument("--model", type=Path, help="start from this HF model folder instead of a new tiny one")
    parser.add_argument("--sft-rows", type=int, default=8192, help="rows of generated SFT data")
    parser.add_argument("overrides", nargs="*", help="sft.KEY=VALUE or rl.KEY=VALUE")
    args = parser.parse_args()
    over = {"sft": [], "rl": []}
    for item in args.overrides:
        stage, _, rest = item.partition(".")
        if stage not in over or "=" not in rest:
            parser.error(f"override {item!r}: expected sft.KEY=VALUE or rl.KEY=VALUE")
        over[stage].append(rest)

    run_dir = args.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    t0 = time.monotonic()
    model = args.model.resolve() if args.model else build_model(run_dir / "base")
    data = run_dir / "sft_data.jsonl"
    if not data.exists():
        write_sft_data(data, args.sft_rows)

    sft_dir = run_dir / "sft"
    if (sft_model := final_weights(sft_dir)) is None or (sft_dir / "running").exists():
        (sft_dir).mkdir(exist_ok=True)
        (sft_dir / "running").touch()
        run(
            [
                str(BIN / "primerl"),
                "sft",
                "@",
                str(HERE / "sft.toml"),
                f"model.name={model}",
                f"run_dir={sft_dir}",
                f"data.path={data}",
                *over["sft"],
            ]
        )
        (sft_dir / "running").unlink()
        sft_model = final_weights(sft_dir)
    times["sft"] = time.monotonic() - t0

    rl_dir = run_dir / "rl"
    t1 = time.monotonic()
    first_step: list[float] = []

    def on_line(line: str) -> None:
        if not first_step and line.startswith("step "):
            first_step.append(time.monotonic())

    run(
        [
            str(BIN / "primerl"),
            "rl",
            "@",
            str(HERE / "rl.toml"),
            f"model.name={sft_model}",
            f"run_dir={rl_dir}",
            *over["rl"],
        ],
        on_line=on_line,
    )
    t2 = time.monotonic()
    times["rl_startup"] = (first_step[0] if first_step else t2) - t1
    times["rl_steps"] = t2 - (first_step[0] if first_step else t2)
    run([str(BIN / "primerl"), "report", str(rl_dir)])

    times["total"] = time.monotonic() - t0
    (run_dir / "times.json").write_text(json.dumps(times, indent=2))
    print(
        f"\nreverse_text: SFT {times['sft']:.0f} s, RL start-up {times['rl_startup']:.0f} s, "
        f"RL steps {times['rl_steps']:.0f} s, total {times['total']:.0f} s"
    )
    print((rl_dir / "report" / "summary.txt").read_text())


if __name__ == "__main__":
    main()
