"""primerl-algos."""
