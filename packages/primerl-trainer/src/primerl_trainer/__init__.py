"""primerl-trainer."""
