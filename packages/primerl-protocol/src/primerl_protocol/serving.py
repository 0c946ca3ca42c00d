"""What a primerl inference server promises its clients beyond the OpenAI API: the admin
routes (their names, the bearer header, the fields of every request and answer) and the
logprobs the servers report. The server (primerl_inference.admin) and its clients (the
orchestrator's server pool, tests, tools) both use these definitions, so neither side can
drift from the other.

The trainer's importance ratios divide its own probability of each sampled token by the one
the server sampled it with, so the server must report the logprobs of the distribution it
really sampled from: `softmax(logits / temperature)`, vLLM's `processed_logprobs` mode (its
default, `raw_logprobs`, reports `softmax(logits)` whatever the temperature). The servers
say which mode they run in on the admin policy route; the orchestrator refuses a server in
any other mode.

    r = httpx.get(url + POLICY_ROUTE, headers=bearer(token))
    policy = decode_answer(PolicyAnswer, r.content, POLICY_ROUTE)   # ValueError if malformed
"""

from __future__ import annotations

import typing

import msgspec

LOGPROBS_MODE = "processed_logprobs"
"""vLLM's `--logprobs-mode` every training server runs with."""

ADMIN_TOKEN_ENV = "PRIMERL_ADMIN_TOKEN"
"""The environment variable that holds the admin token (the servers', and the trainer's when it
sends weights in memory), where no config names it."""
ADMIN_PREFIX = "/admin/"
"""Every route under it needs the bearer token."""
LOAD_WEIGHTS_ROUTE = "/admin/load_weights"
"""POST LoadWeights -> LoadAnswer: swap in a published weights folder (409: refused, old weights kept)."""
PAUSE_ROUTE = "/admin/pause"
"""POST {} -> {"paused": true}: stop admitting generation requests (they wait)."""
RESUME_ROUTE = "/admin/resume"
"""POST {} -> {"paused": false}."""
POLICY_ROUTE = "/admin/policy"
"""GET -> PolicyAnswer: what the server serves now."""
HEALTH_ROUTE = "/admin/health"
"""GET -> HealthAnswer."""
LORA_LOAD_ROUTE = "/admin/lora/load"
"""POST LoraLoad: load a LoRA adapter under a name requests can then use as their `model`;
with a `step`, a published adapter folder that becomes the policy (409: refused, the old
policy kept)."""
LORA_UNLOAD_ROUTE = "/admin/lora/unload"
"""POST LoraUnload."""
WEIGHTS_JOIN_ROUTE = "/admin/weights/join"
"""POST JoinTransfer -> {"joined": true}: the server's workers join the trainer's weight-transfer
group (primerl_protocol.transfer); answers once every member is in (or 409 after its timeout)."""
WEIGHTS_RECEIVE_ROUTE = "/admin/weights/receive"
"""POST ReceiveWeights -> ReceiveAnswer: close the gate, drain, receive the update the trainer
sends in memory, verify it and serve it as policy `step` (409: refused or damaged; the server
then serves the newest folder it loaded, or its base weights, and says which)."""
STEP_HEADER = "x-primerl-policy-step"
"""Response header of every generation request: the policy step that produced it."""
BASE_STEP = -1
"""The policy step a server reports before it has loaded any published folder."""


def adapter_name(step: int, checksum: str | None) -> str:
    """The name a published adapter of policy `step` is served under: one per policy and
    content, so that requests name the policy they want (those of an older policy still in
    flight keep theirs) and two different folders never share a name, nor a prefix-cache entry."""
    return f"policy-{step}" + (f"-{checksum[:12]}" if checksum else "")


def bearer(token: str | None) -> dict[str, str]:
    """The header the admin routes need."""
    return {"Authorization": f"Bearer {token}"}


class _Body(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class LoadWeights(_Body):
    path: str
    """A published weights folder (primerl_protocol.weights)."""
    step: int
    """The policy step it holds, reported by the policy route and the step header from then on."""
    checksum: str | None = None
    """The folder's checksum as published; a folder that does not match is refused."""


class LoadAnswer(_Body):
    step: int
    path: str
    drain_s: float
    """Seconds waited for the requests in flight to finish on the old weights."""
    drained: int
    """How many requests were in flight when the swap closed the gate (it waited for each)."""
    swap_s: float
    """Seconds the new weights took to load."""


class JoinTransfer(_Body):
    host: str
    """The trainer's rendezvous store."""
    port: int
    secret: str
    """The run's secret: every rendezvous key is under it (primerl_protocol.transfer)."""
    rank: int
    """The group rank of this server's first worker (the trainer is rank 0)."""
    world_size: int
    timeout_s: float = 600.0


class ReceiveWeights(_Body):
    step: int
    """The policy step the trainer is sending; a stream of another step is refused."""


class ReceiveAnswer(_Body):
    step: int
    checksum: str
    nbytes: int
    drain_s: float
    drained: int
    swap_s: float
    """Seconds from the gate closed and drained to the new weights served (the transfer included)."""


class LoraLoad(_Body):
    name: str
    """What generation requests name as their `model` to use the adapter."""
    path: str
    """A folder in PEFT's layout (adapter_config.json, adapter_model.safetensors)."""
    step: int | None = None
    """The policy step of a published adapter folder (primerl_protocol.weights): its marker is
    verified (and `checksum` with it), and the adapter becomes the policy the policy route
    reports. None: an adapter loaded beside the policy, the policy unchanged."""
    checksum: str | None = None
    """The folder's checksum as published; a folder that does not match is refused."""


class LoraAnswer(_Body):
    name: str
    path: str
    step: int | None = None
    """The policy step it serves as (None: not a policy)."""
    load_s: float = 0.0
    """Seconds the checks and the load took."""


class LoraUnload(_Body):
    name: str


class PolicyAnswer(_Body):
    step: int
    """BASE_STEP: the weights the server started with."""
    logprobs_mode: str | None
    """The engine's `--logprobs-mode`; None if it cannot be read."""
    path: str | None = None
    checksum: str | None = None
    paused: bool = False
    adapter: str | None = None
    """The LoRA adapter that holds the policy, which generation requests must name as their
    `model`; None: the policy is the served weights themselves (requests name the base model)."""


class HealthAnswer(_Body):
    ready: bool
    paused: bool
    step: int
    in_flight: int
    """Generation requests admitted and not finished."""
    held: int
    """Generation requests waiting at the closed gate (a pause or a swap)."""


_Kind = typing.TypeVar("_Kind", bound=msgspec.Struct)


def decode_request(kind: type[_Kind], body: bytes) -> _Kind:
    """An admin request's body as `kind`; ValueError naming the field that is wrong.

    An empty body is an empty object (routes without fields take none)."""
    try:
        return msgspec.json.decode(body or b"{}", type=kind)
    except msgspec.ValidationError as err:
        raise ValueError(_named(kind, err)) from None
    except msgspec.DecodeError as err:
        raise ValueError(f"request body is not a JSON object: {err}") from None


def decode_answer(kind: type[_Kind], body: bytes, route: str) -> _Kind:
    """A server's answer on `route` as `kind`; ValueError saying what was wrong with it."""
    try:
        return msgspec.json.decode(body, type=kind)
    except (msgspec.ValidationError, msgspec.DecodeError) as err:
        raise ValueError(f"{route} answered something that is not a {kind.__name__} ({err}): {body[:80]!r}") from None


def _named(kind: type[msgspec.Struct], err: msgspec.ValidationError) -> str:
    """msgspec's message, with a missing field named with its type."""
    message = str(err)
    prefix = "Object missing required field `"
    if message.startswith(prefix):
        name = message[len(prefix) :].split("`", 1)[0]
        hint = typing.get_type_hints(kind).get(name)
        return f"field `{name}` ({getattr(hint, '__name__', hint)}) is required"
    if message.startswith("Expected `object`"):
        return "request body must be a JSON object"
    return message
