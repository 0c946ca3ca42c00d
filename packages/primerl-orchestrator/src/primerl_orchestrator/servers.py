"""The inference servers as the orchestrator sees them: health, load, policy, routing.

    pool = ServerPool(urls, model="...", admin_token="...")
    await pool.start()                       # probe every server; refuse to run with none
    async with pool.lease() as server:       # the least-loaded healthy server
        ... every turn of one rollout goes to server.url (sticky: its prefix stays cached)
    await pool.load_weights(path, version, checksum)   # every healthy server, concurrently

A server is healthy when `/health` answers 200, `/v1/models` answers JSON that lists the
model and (for training) its policy route reports the logprobs mode the trainer agrees with
and the policy the run expects it to serve. A rollout that failed at the model call makes the
orchestrator probe its server (`report_failure`); one that fails the probe (killed, hung,
answering garbage) is marked unhealthy and gets no more rollouts. Unhealthy servers are
probed again every `revive_interval_s`.

What a server serves is never assumed: every probe (at start, after a failed rollout, on
revival) asks it. A server that serves some other policy than the current one (it restarted
on its base weights, or was left on another run's step) loads the current weights before it
gets another rollout; at the start of a fresh run, when there is no published folder to
load, a server that serves anything but its base weights is refused, naming what it serves.

Adapters (a LoRA trainer publishes them instead of full weights: format "peft-lora"): each
policy is loaded on every server as a LoRA adapter of its own name (serving.adapter_name),
and a rollout's requests name the adapter of the policy its server served when the rollout
started (`Server.model`), as they name the base model otherwise. An older adapter is
unloaded from a server once no rollout leased on it is still running (at once if none is).
Versions, the policy route, the off-policy bound and revival are the same as with full weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import msgspec
from primerl_protocol.serving import (
    BASE_STEP,
    LOAD_WEIGHTS_ROUTE,
    LORA_LOAD_ROUTE,
    LORA_UNLOAD_ROUTE,
    POLICY_ROUTE,
    WEIGHTS_RECEIVE_ROUTE,
    LoadWeights,
    LoraLoad,
    LoraUnload,
    PolicyAnswer,
    ReceiveWeights,
    adapter_name,
    bearer,
    decode_answer,
)
from primerl_protocol.weights import ADAPTER, FORMATS, FULL, MEMORY

log = logging.getLogger("primerl.orchestrator")

IDLE_CONNECTION_S = 2.0
"""How long an idle connection to a server is kept for the next request. vLLM's uvicorn closes
one idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s by default), and httpx keeps one 5 s by default:
a request sent on a connection idle ~5 s crossed the server's close and failed with ReadError
(an eval whose step took 5 s lost its server that way). Below the server's timeout, a request
never goes out on a connection the server is closing."""


class NotUp(str):
    """A probe's problem that means the server does not serve yet: nothing listens on its port,
    or /health does not answer 200 (vLLM still loading)."""


class NoServerError(RuntimeError):
    """No healthy inference server (says which were tried and what was wrong with each)."""


@dataclass
class Server:
    url: str
    index: int
    healthy: bool = True
    problem: str | None = None
    """Why it is unhealthy."""
    in_flight: int = 0
    """Rollouts running on it now."""
    version: int = 0
    """Policy version it serves (0: the weights it started with), as it last reported it or
    as it was last told to load."""
    rollouts: int = 0
    """Rollouts started on it so far."""
    failures: int = 0
    """Times it was marked unhealthy."""
    model: str = ""
    """What requests for policy `version` name as their model: the base model's name, or the
    policy's adapter."""
    leases: Counter = field(default_factory=Counter)
    """Rollouts running on it, by the policy version they started on."""
    adapters: dict[int, str] = field(default_factory=dict)
    """Policy adapters loaded on it (version -> name), the current one and older ones that
    rollouts still use."""


@dataclass
class Weights:
    path: str
    version: int
    checksum: str | None
    format: str = FULL
    """primerl_protocol.weights.FULL (whole weights), ADAPTER (a LoRA adapter) or MEMORY (whole
    weights the trainer sends to the servers in `served`; `path` a folder of them, or "")."""
    served: tuple[str, ...] = ()

    @property
    def adapter(self) -> str | None:
        """The name the adapter is served under (None: full weights)."""
        return adapter_name(self.version, self.checksum) if self.format == ADAPTER else None


class ServerPool:
    def __init__(
        self,
        urls: list[str],
        model: str,
        admin_token: str | None,
        *,
        probe_timeout_s: float = 5.0,
        load_timeout_s: float = 600.0,
        revive_interval_s: float = 10.0,
        wait_timeout_s: float = 600.0,
        logprobs_mode: str | None = None,
    ) -> None:
        if not urls:
            raise NoServerError("no inference servers configured (inference.urls, or inference.port/num_replicas)")
        self.servers = [Server(url.rstrip("/"), i, model=model) for i, url in enumerate(urls)]
        self.model = model
        self.admin_token = admin_token
        self.probe_timeout_s = probe_timeout_s
        self.load_timeout_s = load_timeout_s
        self.revive_interval_s = revive_interval_s
        self.wait_timeout_s = wait_timeout_s
        self.logprobs_mode = logprobs_mode
        """The logprobs mode a server must report on its policy route (None: not checked)."""
        self.weights: Weights | None = None
        """The weights every server should serve (None: the ones they started with)."""
        self.any_policy = False
        """Whether a server may serve any policy while `weights` is None (a resumed run: the
        trainer publishes its restored weights before anything is generated)."""
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(probe_timeout_s), limits=httpx.Limits(keepalive_expiry=IDLE_CONNECTION_S)
        )
        self._changed = asyncio.Event()
        self._last_revive = time.monotonic()
        self._unloads: set[asyncio.Task] = set()

    # -- health -----------------------------------------------------------------------

    async def probe(self, server: Server) -> str | None:
        """What is wrong with `server`, or None when it serves the model (a `NotUp` problem:
        it does not serve yet)."""
        try:
            r = await self._http.get(server.url + "/health")
            if r.status_code != 200:
                return NotUp(f"/health answered HTTP {r.status_code}")
            r = await self._http.get(server.url + "/v1/models")
            if r.status_code != 200:
                return f"/v1/models answered HTTP {r.status_code}"
            try:
                ids = [m["id"] for m in r.json()["data"]]
            except (ValueError, KeyError, TypeError):
                return f"/v1/models answered something that is not a model list: {r.text[:80]!r}"
            if self.model not in ids:
                return f"serves {ids}, not {self.model!r}"
            if self.logprobs_mode is not None:
                return await self._check_policy(server)
        except httpx.HTTPError as err:
            problem = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
            return NotUp(problem) if isinstance(err, httpx.ConnectError) else problem
        return None

    async def _check_policy(self, server: Server) -> str | None:
        """What is wrong with the policy `server` reports (its logprobs mode, the weights it
        serves), or None; a server on the wrong weights loads the current ones first."""
        r = await self._http.get(server.url + POLICY_ROUTE, headers=bearer(self.admin_token))
        if r.status_code != 200:
            return f"{POLICY_ROUTE} answered HTTP {r.status_code} (is it a primerl-inference server, with this admin token?)"
        try:
            policy = decode_answer(PolicyAnswer, r.content, POLICY_ROUTE)
        except ValueError as err:
            return str(err)
        if policy.logprobs_mode != self.logprobs_mode:
            return (
                f"reports logprobs in vLLM's {policy.logprobs_mode!r} mode, not {self.logprobs_mode!r}: its "
                f"logprobs would not describe the distribution it samples from at temperatures other than 1 "
                f"(start it with --logprobs-mode {self.logprobs_mode}, as primerl-inference does)"
            )
        w = self.weights
        if w is None:
            # Step 0 is policy 0, the base weights loaded from a folder (a reset).
            if policy.step in (BASE_STEP, 0) or self.any_policy:
                server.version = max(policy.step, 0)
                server.model = policy.adapter or self.model
                return None
            return (
                f"serves policy {policy.step} (from {policy.path}), not the base weights this run starts "
                "from, and there is no published folder of those to load: restart it, or resume the run "
                "that left it there"
            )
        if (
            policy.step == w.version
            and (w.checksum is None or policy.checksum == w.checksum)
            and policy.adapter == w.adapter
        ):
            server.version, server.model = w.version, w.adapter or self.model
            return None
        log.warning(
            "inference server %s serves policy %d (%s), not the current policy %d: loading it",
            server.url,
            policy.step,
            policy.path,
            w.version,
        )
        try:
            await self._load(server, w)
        except RuntimeError as err:
            return f"serves policy {policy.step}, not the current {w.version}, and could not load it: {err}"
        return None

    def mark_unhealthy(self, server: Server, problem: str) -> None:
        if server.healthy:
            server.failures += 1
            log.warning("inference server %s is unhealthy (%s); its rollouts go to the others", server.url, problem)
        server.healthy, server.problem = False, problem

    async def start(self, *, any_policy: bool = False, wait_s: float = 0.0) -> None:
        """Probe every server; at least one must serve the model. `any_policy`: the servers
        may serve any weights until the first `load_weights` (a resumed run). `wait_s`: while
        none serves but none is wrong either (nothing listens yet, /health not 200: servers
        that are still starting), probe again for up to this long; the others join later
        (`revive`)."""
        self.any_policy = any_policy
        deadline = time.monotonic() + wait_s
        next_note = time.monotonic() + 15.0
        while True:
            problems = await asyncio.gather(*(self.probe(s) for s in self.servers))
            if (
                any(p is None for p in problems)
                or not all(isinstance(p, NotUp) for p in problems)
                or time.monotonic() >= deadline
            ):
                break
            if time.monotonic() >= next_note:
                log.info(
                    "waiting for an inference server to come up (%s; %.0f s left)",
                    "; ".join(f"{s.url}: {p}" for s, p in zip(self.servers, problems)),
                    deadline - time.monotonic(),
                )
                next_note += 15.0
            await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        for server, problem in zip(self.servers, problems):
            if problem:
                self.mark_unhealthy(server, problem)
        if not self.healthy():
            raise NoServerError(self._none_healthy())

    def healthy(self) -> list[Server]:
        return [s for s in self.servers if s.healthy]

    def _none_healthy(self) -> str:
        lines = "; ".join(f"{s.url}: {s.problem}" for s in self.servers)
        return f"no healthy inference server serving {self.model!r} ({lines})"

    async def report_failure(self, server: Server, error: str) -> bool:
        """A rollout on `server` failed at the model call; True if the server is at fault."""
        problem = await self.probe(server)
        if problem:
            self.mark_unhealthy(server, f"{problem}; a rollout failed with: {error[:200]}")
            return True
        return False

    async def revive(self) -> None:
        """Probe the unhealthy servers; bring back those that serve again (current weights first)."""
        self._last_revive = time.monotonic()
        for server in [s for s in self.servers if not s.healthy]:
            if problem := await self.probe(server):  # the probe loads the current weights if need be
                server.problem = problem
                continue
            server.healthy, server.problem = True, None
            log.info("inference server %s is healthy again (policy %d)", server.url, server.version)
            self._changed.set()

    # -- routing ----------------------------------------------------------------------

    def pick(self) -> Server | None:
        """The healthy server with the fewest rollouts in flight (ties: fewest so far)."""
        candidates = self.healthy()
        if not candidates:
            return None
        return min(candidates, key=lambda s: (s.in_flight, s.rollouts, s.index))

    @contextlib.asynccontextmanager
    async def lease(self) -> AsyncIterator[Server]:
        """A server for one rollout, counted as in flight on it until the block ends.

        With no healthy server, waits (probing the unhealthy ones) up to `wait_timeout_s`,
        then raises NoServerError."""
        deadline = time.monotonic() + self.wait_timeout_s
        while (server := self.pick()) is None:
            if time.monotonic() > deadline:
                raise NoServerError(self._none_healthy())
            await self.revive()
            if self.pick() is None:
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), timeout=min(self.revive_interval_s, 2.0))
        version = server.version
        server.in_flight += 1
        server.rollouts += 1
        server.leases[version] += 1
        try:
            yield server
        finally:
            server.in_flight -= 1
            server.leases[version] -= 1
            if not server.leases[version]:
                del server.leases[version]
                if version != server.version and version in server.adapters:  # the last rollout on it
                    self._spawn_unload(server)

    async def maybe_revive(self) -> None:
        """Revive unhealthy servers if the interval has passed (cheap to call often)."""
        if any(not s.healthy for s in self.servers) and time.monotonic() - self._last_revive > self.revive_interval_s:
            await self.revive()

    # -- weights ----------------------------------------------------------------------

    async def _post(self, server: Server, route: str, body, timeout_s: float) -> None:
        """POST an admin request; RuntimeError saying what went wrong."""
        if not self.admin_token:
            raise RuntimeError("no admin token (inference.admin_token or $PRIMERL_ADMIN_TOKEN) to load weights with")
        try:
            r = await self._http.post(
                server.url + route,
                content=msgspec.json.encode(body),
                headers={**bearer(self.admin_token), "content-type": "application/json"},
                timeout=timeout_s,
            )
        except httpx.HTTPError as err:
            raise RuntimeError(f"{route}: {type(err).__name__}: {err}") from None
        if r.status_code != 200:
            raise RuntimeError(f"{route} answered HTTP {r.status_code}: {r.text[:300]}")

    async def _load(self, server: Server, w: Weights, receive: bool = False) -> None:
        """Have `server` serve `w`. Weights in memory are received only when the trainer is
        sending them (`receive`: from load_weights); later (a probe, a revival) only a folder
        of them can be loaded."""
        if w.format == MEMORY and receive and server.url in w.served:
            await self._post(server, WEIGHTS_RECEIVE_ROUTE, ReceiveWeights(step=w.version), self.load_timeout_s)
            server.adapters.clear()
        elif w.format == MEMORY and not w.path:
            raise RuntimeError(
                f"policy {w.version} was sent in memory and there is no folder of it to load "
                "(trainer.weights.folder_every); this server gets the next policy the trainer sends"
            )
        elif w.adapter is None:
            await self._post(
                server,
                LOAD_WEIGHTS_ROUTE,
                LoadWeights(path=w.path, step=w.version, checksum=w.checksum),
                self.load_timeout_s,
            )
            server.adapters.clear()  # the server dropped them: they adapted the weights it replaced
        else:
            await self._post(
                server,
                LORA_LOAD_ROUTE,
                LoraLoad(name=w.adapter, path=w.path, step=w.version, checksum=w.checksum),
                self.load_timeout_s,
            )
            server.adapters[w.version] = w.adapter
        server.version, server.model = w.version, w.adapter or self.model
        await self._unload_idle(server)

    async def _unload_idle(self, server: Server) -> None:
        """Unload the adapters of older policies that no rollout on `server` still uses."""
        for version, name in list(server.adapters.items()):
            if (
                version != server.version
                and not server.leases[version]
                and server.adapters.pop(version, None) is not None
            ):  # (not another task's already)
                try:
                    await self._post(server, LORA_UNLOAD_ROUTE, LoraUnload(name=name), self.probe_timeout_s)
                except RuntimeError as err:  # gone already (the server restarted): nothing to free
                    log.info(
                        "inference server %s: unloading adapter %s of policy %d: %s", server.url, name, version, err
                    )

    def _spawn_unload(self, server: Server) -> None:
        task = asyncio.get_running_loop().create_task(self._unload_idle(server))
        self._unloads.add(task)
        task.add_done_callback(self._unloads.discard)

    async def load_weights(
        self, path: str, version: int, checksum: str | None = None, format: str = FULL, served: list[str] | None = None
    ) -> float:
        """Every healthy server loads the weights at `path` as policy `version`; seconds taken.
        `format` (primerl_protocol.weights): FULL weights replace the served ones; an ADAPTER
        is loaded beside the base weights, and requests name it from then on; MEMORY weights
        are received from the trainer by the servers in `served` (the trainer is sending them),
        and loaded from the folder `path` by the others if there is one.

        A server that fails to load is marked unhealthy (it would serve an old policy);
        weights refused by every server raise NoServerError."""
        if format not in (*FORMATS, MEMORY):
            raise ValueError(
                f"policy {version} at {path} has format {format!r}, not one of {', '.join(FORMATS)}, {MEMORY}"
            )
        t0 = time.monotonic()
        # in memory: the stream's checksum is not the folder's, so a probe checks the step only
        self.weights = w = Weights(
            path, version, None if format == MEMORY else checksum, format, tuple(u.rstrip("/") for u in served or ())
        )
        # In memory, every server the trainer sends to must receive, healthy or not: the trainer's
        # stream to it waits for it (until its timeout) otherwise; one that receives serves again.
        servers = [s for s in self.servers if s.healthy or (format == MEMORY and s.url in w.served)]
        results = await asyncio.gather(*(self._load(s, w, receive=True) for s in servers), return_exceptions=True)
        for server, result in zip(servers, results):
            if isinstance(result, BaseException):
                self.mark_unhealthy(server, f"loading policy {version} from {path or 'memory'} failed: {result}")
            elif not server.healthy and (problem := await self.probe(server)) is None:
                server.healthy, server.problem = True, None
                log.info("inference server %s is healthy again (policy %d, received in memory)", server.url, version)
            elif not server.healthy:
                server.problem = problem
        if not self.healthy():
            raise NoServerError(self._none_healthy())
        return time.monotonic() - t0

    @property
    def version(self) -> int:
        """The policy version every healthy server serves (the oldest of them)."""
        return min((s.version for s in self.healthy()), default=0)

    def stats(self) -> dict[str, float]:
        return {
            "servers/healthy": float(len(self.healthy())),
            "servers/unhealthy": float(len(self.servers) - len(self.healthy())),
            "servers/in_flight": float(sum(s.in_flight for s in self.servers)),
        }

    async def close(self) -> None:
        for task in list(self._unloads):
            task.cancel()
        await asyncio.gather(*self._unloads, return_exceptions=True)
        await self._http.aclose()
