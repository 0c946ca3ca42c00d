"""primerl: the commands."""
