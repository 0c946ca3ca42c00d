"""Loading every command's config imports neither torch nor vLLM (they take seconds to import)."""

import subprocess
import sys

CHECK = """
import sys
from primerl.configs import EvalConfig, RLConfig, SFTConfig
from primerl_protocol.config import load_config
import primerl.cli  # the command module itself stays light too
cfg = load_config(RLConfig, ["model.name=tiny", "trainer.optimizer.lr=1e-5"])
assert cfg.trainer.optimizer.lr == 1e-5
heavy = sorted(m for m in ("torch", "vllm", "transformers", "verifiers") if m in sys.modules)
print(heavy)
"""


def test_loading_configs_imports_no_torch_or_vllm():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
