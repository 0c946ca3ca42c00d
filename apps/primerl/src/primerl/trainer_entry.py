"""`python -m primerl.trainer_entry @ cfg.toml`: the trainer command, for torchrun's `-m`."""

from primerl.cli import trainer_main
from primerl.torchrun import run_and_exit

if __name__ == "__main__":
    run_and_exit(trainer_main)
