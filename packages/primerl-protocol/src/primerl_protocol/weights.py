"""The contract of a published weights folder, shared by the trainer that writes it and the
inference servers that load it.

A folder `weights/step_N` (names, staging and renaming: rundir.py) is complete when its
marker `primerl.json` exists (written last, before the folder is renamed into place); the
marker lists the weight files and their checksum: xxh3-128 over each file's name and bytes,
in name order (several GB/s; blake2b's ~1 GB/s alone took seconds for a 2B model), and the
folder's format:

  FULL     "hf-safetensors": a whole model in Hugging Face layout (config.json, *.safetensors),
           loaded in place of the served weights (/admin/load_weights);
  ADAPTER  "peft-lora": a LoRA adapter in PEFT's layout (ADAPTER_CONFIG + ADAPTER_WEIGHTS, the
           served base model's names), loaded beside the base weights (/admin/lora/load).
"""

from __future__ import annotations

import json
from pathlib import Path

import xxhash

MARKER = "primerl.json"
ALGORITHM = "xxh3_128"
FULL = "hf-safetensors"
"""Format of a folder of whole-model weights (Hugging Face layout)."""
ADAPTER = "peft-lora"
"""Format of a folder holding a LoRA adapter in PEFT's layout."""
FORMATS = (FULL, ADAPTER)
MEMORY = "memory"
"""PolicyReady.format of weights the trainer sent in memory (trainer.weights.transport =
"memory", primerl_protocol.transfer): no folder of them exists unless PolicyReady.location
names one; the servers listed in PolicyReady.served received them."""
ADAPTER_CONFIG = "adapter_config.json"
"""PEFT's adapter config (peft_type, r, lora_alpha, target_modules, rank_pattern, ...)."""
ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""PEFT's adapter tensors: `base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]."""


def checksum(folder: str | Path, files: list[str]) -> str:
    h = xxhash.xxh3_128()
    folder = Path(folder)
    for name in sorted(files):
        h.update(name.encode())
        with (folder / name).open("rb") as f:
            while chunk := f.read(16 << 20):
                h.update(chunk)
    return h.hexdigest()


def write_marker(folder: str | Path, step: int, files: list[str], created_at: float, format: str = FULL) -> str:
    """Checksum `files` and write the marker; returns the checksum."""
    if format not in FORMATS:
        raise ValueError(f"unknown published-folder format {format!r} (one of {', '.join(FORMATS)})")
    digest = checksum(folder, files)
    marker = {
        "step": step,
        "files": sorted(files),
        "checksum": digest,
        "algorithm": ALGORITHM,
        "time": created_at,
        "format": format,
    }
    (Path(folder) / MARKER).write_text(json.dumps(marker))
    return digest


def verify(folder: str | Path, expected: str | None = None) -> dict:
    """The marker of a published folder after checking it; ValueError naming what is wrong."""
    folder = Path(folder)
    marker = folder / MARKER
    if not folder.is_dir():
        raise ValueError(f"{folder}: no such folder")
    if not marker.exists():
        raise ValueError(f"{folder}: no {MARKER}: not a complete published weights folder")
    try:
        meta = json.loads(marker.read_text())
        files = meta["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{marker}: unreadable marker ({err})") from None
    missing = [f for f in files if not (folder / f).exists()]
    if missing:
        raise ValueError(f"{folder}: files listed in {MARKER} are missing: {', '.join(missing)}")
    got = checksum(folder, files)
    if got != meta["checksum"]:
        raise ValueError(f"{folder}: checksum {got} does not match {meta['checksum']} (corrupt or modified)")
    if expected is not None and expected != got:
        raise ValueError(f"{folder}: checksum {got} is not the expected {expected}")
    return meta


def format_of(meta: dict) -> str:
    """The format of a verified folder's marker (FULL for markers written before formats existed)."""
    return meta.get("format", FULL)
