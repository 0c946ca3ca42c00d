"""`python -m primerl.trainer_entry @ cfg.toml`: the trainer command, for torchrun's `-m`."""

from primerl.cli import trainer_main

if __name__ == "__main__":
    trainer_main()
