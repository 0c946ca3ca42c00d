"""`python -m primerl.orch_entry @ cfg.toml`: the orchestrator command, as `primerl rl` starts it."""

from primerl.cli import orch_main

if __name__ == "__main__":
    orch_main()
