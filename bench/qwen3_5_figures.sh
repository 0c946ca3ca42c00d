#!/usr/bin/env bash
# Issue 23's figures on one H200 (same call): the GPU tests of the recurrent mixers, the scan
# kernel's settings and one layer's profile, the conv kernels' tile sweep, then Qwen3.5-0.8B's
# text shape at 8,192 and 16,384 tokens (one step's timeline traced, its gaps read by
# trace_gaps.py) and Qwen3.5-35B-A3B's cut to 4 layers, ours against transformers' torch fallback.
# Issue 25's: Qwen3.5-0.8B as a vision-language model, 8 images of 448 x 448 in a row of 8,192
# tokens, the vision tower frozen and trained (last).
# With flash-linear-attention importable (`fla-core`; FLA=folder holding it where it is not
# installed) the DeltaNet layers take fla's kernels, and gdn_kernels.py compares them with the
# fp32 form; `ours:torchgdn` is the fp32 form in the model.
#   FLA=.devwheels/fla bash bench/qwen3_5_figures.sh OUT_DIR
set -u
out=${1:?output folder}
export PYTHONPATH=packages/primerl-models/src${FLA:+:$FLA}
python3 -m pytest -q packages/primerl-models/tests/test_cuda.py -s -p no:cacheprovider \
  -k "delta_rule or bf16_model or fla or logprobs or conv_kernels or fast_deltanet" \
  > "$out/test_cuda.log" 2>&1
grep -E "ratio|passed|failed|Error" "$out/test_cuda.log" | tail -12
python3 bench/scan_kernel.py --heads 16 --tokens 16384 --out "$out/scan16.json" > "$out/scan16.log" 2>&1
grep -E "best|gated_delta_rule" "$out/scan16.log"
python3 bench/gdn_kernels.py --out "$out/gdn.json" > "$out/gdn.log" 2>&1
tail -5 "$out/gdn.log"
python3 bench/conv_kernels.py --out "$out/conv.json" > "$out/conv.log" 2>&1
tail -1 "$out/conv.log"
python3 bench/model_step.py --models qwen3.5-0.8b --runs ours:keep,ours,ours:docs4,ours:torchgdn --steps 5 --seq 16384 --profile \
  --trace "$out/trace-{run}.json.gz" --out "$out/q08-16k.json" > "$out/q08-16k.log" 2>&1
tail -5 "$out/q08-16k.log"
python3 bench/trace_gaps.py "$out/trace-ours-keep.json.gz" | head -3
python3 bench/model_step.py --models qwen3.5-0.8b --runs ours,transformers --steps ${STEPS:-5} --seq 8192 \
  --out "$out/q08-8k.json" 2>&1 | tail -3
python3 bench/model_step.py --models qwen3.5-35b-a3b-4l --runs ours,transformers --steps ${STEPS:-5} --seq 8192 \
  --out "$out/q35-8k.json" 2>&1 | tail -3
python3 bench/model_step.py --models qwen3.5-0.8b-vl --runs ours,transformers,ours:tower,transformers:tower \
  --steps ${STEPS:-5} --out "$out/q08-vl-8k.json" 2>&1 | tail -6
