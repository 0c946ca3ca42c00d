"""primerl-models."""
