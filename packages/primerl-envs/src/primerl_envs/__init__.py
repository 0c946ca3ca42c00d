"""primerl-envs."""
