"""`python -m primerl.sft_entry @ cfg.toml`: `primerl sft`, for torchrun's `-m`."""

from primerl.cli import main

if __name__ == "__main__":
    main(["sft", *__import__("sys").argv[1:]])
