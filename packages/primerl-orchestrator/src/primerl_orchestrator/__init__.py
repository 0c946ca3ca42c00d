"""primerl-orchestrator."""
