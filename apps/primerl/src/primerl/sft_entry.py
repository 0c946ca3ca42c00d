"""`python -m primerl.sft_entry @ cfg.toml`: `primerl sft`, for torchrun's `-m`."""

import sys

from primerl.cli import main
from primerl.torchrun import run_and_exit

if __name__ == "__main__":
    run_and_exit(main, ["sft", *sys.argv[1:]])
