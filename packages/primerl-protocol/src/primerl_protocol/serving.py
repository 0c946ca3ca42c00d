"""What a primerl inference server promises its clients beyond the OpenAI API.

The trainer's importance ratios divide its own probability of each sampled token by the one
the server sampled it with, so the server must report the logprobs of the distribution it
really sampled from: `softmax(logits / temperature)`, vLLM's `processed_logprobs` mode (its
default, `raw_logprobs`, reports `softmax(logits)` whatever the temperature). The servers
say which mode they run in on the admin policy route; the orchestrator refuses a server in
any other mode.
"""

from __future__ import annotations

LOGPROBS_MODE = "processed_logprobs"
"""vLLM's `--logprobs-mode` every training server runs with."""
POLICY_ROUTE = "/admin/policy"
"""GET: {"step", "path", "checksum", "paused", "logprobs_mode"} of the server."""
