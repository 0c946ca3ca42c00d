"""primerl-inference."""
