"""primerl's admin routes inside vLLM's own OpenAI server, as an ASGI middleware.

vLLM loads it with `--middleware primerl_inference.admin.AdminMiddleware` (the launcher adds
it); nothing in vLLM is patched. Every route under /admin/ needs `Authorization: Bearer
<token>` ($PRIMERL_ADMIN_TOKEN; no token configured means the admin routes answer 401 to
everyone). The routes, and the fields of every request and answer, are defined in
primerl_protocol.serving, which the orchestrator uses too (JSON in, JSON out):

  POST /admin/load_weights  LoadWeights {"path", "step", "checksum"?}   swap in a published folder
  POST /admin/lora/load     LoraLoad {"name", "path", "step"?, "checksum"?}   load a LoRA adapter
  POST /admin/lora/unload   LoraUnload {"name"}
  POST /admin/pause  /  POST /admin/resume                              stop / restart admitting requests
  GET  /admin/policy        PolicyAnswer {"step", "path", "checksum", "paused", "logprobs_mode", "adapter"}
  GET  /admin/health        HealthAnswer {"ready", "paused", "step", "in_flight", "held"}
  POST /admin/weights/join     JoinTransfer {"host", "port", "secret", "rank", "world_size", "timeout_s"?}
  POST /admin/weights/receive  ReceiveWeights {"step"} -> ReceiveAnswer   weights in memory (below)

A request body with a missing, mistyped or unknown field is answered 400 naming the field.

Weight swaps and requests in flight: a swap first closes the gate to new generation requests
(they wait, they are not refused), waits for the requests in flight to finish on the old
weights, verifies the folder's checksum (a half-written or corrupt folder is refused with 409
and the old weights keep serving), reloads the weights in place, drops the prefix cache (no
entry computed with old weights survives), and reopens the gate. So every response was
produced by exactly one policy, and each response carries it in the header
`x-primerl-policy-step`.

Weights in memory (trainer.weights.transport = "memory"; primerl_protocol.transfer): the server
joins the trainer's transfer group once (the join route; vLLM's `init_weight_transfer_engine`
with our `primerl_gloo` engine, transfer.py), then each receive closes the gate and drains as a
swap does, and runs vLLM's own update cycle (`start_weight_update`, `update_weights`,
`finish_weight_update`: the engine client's methods that vLLM's RL routes call; those routes
are not mounted outside vLLM's dev mode and have no token, so they are driven from here,
behind the admin token). The update is served only if every worker received it whole (the
stream's checksum); otherwise, since a part of it may already be loaded, the server reloads the
newest folder it loaded (its base weights if none), serves that, and answers 409 saying so.

Adapters as policies (a LoRA trainer publishes adapters, not models): a LoraLoad with a
`step` is a published adapter folder; its checksum is verified first (refused with 409, the
old policy kept), it is loaded under its own name beside the base weights (which must be the
base ones: an adapter applies to them), and it becomes the policy the policy route reports,
with the name requests must give as their `model`. No gate is closed: requests in flight on
an older adapter keep it (they named it), new ones name the new one. The step header of a
request is then the step of the adapter it named (the served weights' step for the base
model's name). A weight swap drops the policy adapters (they adapted the old weights).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from dataclasses import dataclass, field

import msgspec
from primerl_protocol import serving
from primerl_protocol.serving import (
    HealthAnswer,
    JoinTransfer,
    LoadAnswer,
    LoadWeights,
    LoraAnswer,
    LoraLoad,
    LoraUnload,
    PolicyAnswer,
    ReceiveAnswer,
    ReceiveWeights,
    decode_request,
)
from primerl_protocol.weights import ADAPTER, format_of, verify

from primerl_inference.config import ADMIN_TOKEN_ENV

log = logging.getLogger("primerl.inference")

STEP_HEADER = serving.STEP_HEADER.encode()
VLLM_LORA_ROUTES = {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
"""vLLM's routes that swap LoRA adapters (with inference.enable_lora): they need the admin token."""


class AdminError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class Policy:
    step: int = serving.BASE_STEP
    """BASE_STEP: the weights the server started with."""
    path: str | None = None
    checksum: str | None = None
    adapter: str | None = None
    """The LoRA adapter holding this policy (None: the served weights are the policy)."""
    loaded_at: float = field(default_factory=time.time)


class _Model(msgspec.Struct):
    model: str | None = None


def _model_of(body: bytes) -> str | None:
    """The `model` a generation request's JSON body names (None if it names none or is not JSON)."""
    try:
        return msgspec.json.decode(body, type=_Model).model
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _replay(body: bytes, receive):
    """An ASGI `receive` that gives `body` (already read) first, then whatever `receive` gives."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def again():
        return pending.pop() if pending else await receive()

    return again


class Gate:
    """Admission of generation requests, closed while weights change."""

    def __init__(self) -> None:
        self.cond = asyncio.Condition()
        self.active = 0
        self.held = 0  # waiting in enter()
        self.closed = 0  # nesting: a pause inside a swap

    async def enter(self) -> None:
        async with self.cond:
            self.held += 1
            try:
                await self.cond.wait_for(lambda: not self.closed)
            finally:
                self.held -= 1
            self.active += 1

    async def leave(self) -> None:
        """Count a request out. The count drops at once, before the lock is waited for: a
        request cancelled again while it waits (its `finally` already runs on a cancellation)
        would otherwise stay counted, and every later close() would wait for it for ever."""
        self.active -= 1
        await asyncio.shield(self._wake())

    async def _wake(self) -> None:
        async with self.cond:
            self.cond.notify_all()

    async def close(self) -> int:
        """Stop admitting, then wait until nothing admitted is still running; how many were.

        Cancelled (or failing) while it waits, it reopens what it closed: its caller, who gets
        no return, has nothing to pair an open() with.
        """
        async with self.cond:
            self.closed += 1
            running = self.active
            try:
                await self.cond.wait_for(lambda: self.active == 0)
            except BaseException:
                self.closed -= 1
                self.cond.notify_all()
                raise
            return running

    async def open(self) -> None:
        async with self.cond:
            self.closed = max(0, self.closed - 1)
            self.cond.notify_all()


async def _read_body(receive) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    return body


def _parse(kind, body: bytes):
    try:
        return decode_request(kind, body)
    except ValueError as err:
        raise AdminError(400, str(err)) from None


async def _respond(send, status: int, payload) -> None:
    body = msgspec.json.encode(payload)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _logprobs_mode(app) -> str | None:
    """The engine's `--logprobs-mode` (what its logprobs describe), None if it cannot be read."""
    model_config = getattr(getattr(app.state, "vllm_config", None), "model_config", None)
    return getattr(model_config, "logprobs_mode", None)


async def _reset_prefix_cache(engine) -> None:
    """Drop every prefix-cache entry after the weights changed. Nothing is running (the gate is
    closed and drained), so the reset succeeds; if vLLM still declines, force it rather than
    serve blocks computed with old weights."""
    if not await engine.reset_prefix_cache():
        await engine.reset_prefix_cache(reset_running_requests=True)


class AdminMiddleware:
    """ASGI middleware: admin routes, the swap gate, and the policy-step header."""

    def __init__(self, app) -> None:
        self.app = app
        self.token = os.environ.get(ADMIN_TOKEN_ENV)
        self.weights = Policy()
        """The weights the engine serves (the base ones, or a published folder loaded in place)."""
        self.policy = self.weights
        """The current policy: `weights`, or the adapter last loaded as a policy."""
        self.folder = self.weights
        """The newest weights loaded from a folder (the base ones before any): what a failed
        in-memory update falls back to."""
        self.joined = False
        """Whether the workers are in a trainer's transfer group."""
        self.adapter_steps: dict[str, int] = {}
        """Adapters loaded as policies: name -> step (for the step header of requests naming them)."""
        self.gate: Gate | None = None  # made inside the server's event loop
        self.swap_lock: asyncio.Lock | None = None
        self.paused = False

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.gate is None:
            self.gate, self.swap_lock = Gate(), asyncio.Lock()
        if scope["path"].startswith(serving.ADMIN_PREFIX):
            return await self._admin(scope, receive, send)
        if scope["path"].rstrip("/") in VLLM_LORA_ROUTES and not self._authorised(scope):
            # vLLM's own, open to anyone when runtime LoRA updates are on: the admin token too
            return await _respond(send, 401, {"error": "missing or wrong bearer token for the LoRA routes"})
        if scope["method"] != "POST":  # health, models, metrics: never gated
            return await self.app(scope, receive, send)
        model = None
        if self.adapter_steps:  # the step is the adapter's the request names: read its body
            body = await _read_body(receive)
            model, receive = _model_of(body), _replay(body, receive)
        await self.gate.enter()
        step = str(self.weights.step if model is None else self.adapter_steps.get(model, self.weights.step)).encode()

        async def send_with_step(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=[*message.get("headers", []), (STEP_HEADER, step)])
            await send(message)

        try:
            await self.app(scope, receive, send_with_step)
        finally:
            await self.gate.leave()

    # -- admin ------------------------------------------------------------------------

    def _admission(self) -> tuple[Gate, asyncio.Lock]:
        """The gate and the swap lock, for the admin routes (which __call__ reaches only after
        it has made both)."""
        assert self.gate is not None and self.swap_lock is not None, "__call__ makes both before any admin route"
        return self.gate, self.swap_lock

    def _authorised(self, scope) -> bool:
        if not self.token:
            return False
        headers = dict(scope.get("headers", []))
        # In constant time: a byte-by-byte comparison tells a timing attacker how much was right.
        return hmac.compare_digest(headers.get(b"authorization", b""), f"Bearer {self.token}".encode())

    async def _admin(self, scope, receive, send) -> None:
        gate, swap_lock = self._admission()
        if not self._authorised(scope):
            return await _respond(send, 401, {"error": "missing or wrong bearer token for the admin routes"})
        route = (scope["method"], scope["path"].rstrip("/"))
        try:
            body = await _read_body(receive) if scope["method"] == "POST" else b""
            engine = scope["app"].state.engine_client
            match route:
                case ("POST", serving.LOAD_WEIGHTS_ROUTE):
                    result = await self._load_weights(scope["app"], engine, _parse(LoadWeights, body))
                case ("POST", serving.PAUSE_ROUTE):
                    if not self.paused:
                        self.paused = True
                        # Shielded: a pause cancelled while it drains still holds the gate
                        # (`paused` says so, and the resume reopens it), as it always did.
                        await asyncio.shield(gate.close())
                    result = {"paused": True}
                case ("POST", serving.RESUME_ROUTE):
                    if self.paused:
                        self.paused = False
                        await gate.open()
                    result = {"paused": False}
                case ("GET", serving.POLICY_ROUTE):
                    p = self.policy
                    result = PolicyAnswer(
                        step=p.step,
                        path=p.path,
                        checksum=p.checksum,
                        paused=self.paused,
                        logprobs_mode=_logprobs_mode(scope["app"]),
                        adapter=p.adapter,
                    )
                case ("GET", serving.HEALTH_ROUTE):
                    result = HealthAnswer(
                        ready=not self.paused and not swap_lock.locked(),
                        paused=self.paused,
                        step=self.policy.step,
                        in_flight=gate.active,
                        held=gate.held,
                    )
                case ("POST", serving.WEIGHTS_JOIN_ROUTE):
                    result = await self._join(scope["app"], engine, _parse(JoinTransfer, body))
                case ("POST", serving.WEIGHTS_RECEIVE_ROUTE):
                    result = await self._receive_weights(scope["app"], engine, _parse(ReceiveWeights, body))
                case ("POST", serving.LORA_LOAD_ROUTE):
                    result = await self._load_lora(scope["app"], _parse(LoraLoad, body))
                case ("POST", serving.LORA_UNLOAD_ROUTE):
                    result = await self._unload_lora(scope["app"], _parse(LoraUnload, body))
                case _:
                    raise AdminError(404, f"no admin route {scope['method']} {scope['path']}")
        except AdminError as err:
            return await _respond(send, err.status, {"error": str(err)})
        except Exception as err:  # the engine failed: say so, keep the server up
            log.exception("admin %s failed", route)
            return await _respond(send, 500, {"error": f"{type(err).__name__}: {err}"})
        await _respond(send, 200, result)

    async def _load_weights(self, app, engine, req: LoadWeights) -> LoadAnswer:
        gate, swap_lock = self._admission()
        path, step, expected = req.path, req.step, req.checksum
        async with swap_lock:
            # Checked before anything changes: a bad folder leaves the old weights serving.
            try:
                meta = await asyncio.to_thread(verify, path, expected)
            except ValueError as err:
                raise AdminError(409, f"refused weights for step {step}: {err}") from None
            t0 = time.monotonic()
            drained = await gate.close()  # requests in flight finish on the old weights
            try:
                waited = time.monotonic() - t0
                await engine.collective_rpc("primerl_reload_weights", kwargs={"weights_path": path})
                await _reset_prefix_cache(engine)
                self.weights = self.policy = self.folder = Policy(step=step, path=path, checksum=meta["checksum"])
                await self._drop_policy_adapters(app)
            finally:
                await gate.open()
            return LoadAnswer(
                step=step, path=path, drain_s=waited, drained=drained, swap_s=time.monotonic() - t0 - waited
            )

    async def _join(self, app, engine, req: JoinTransfer) -> dict:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        _, swap_lock = self._admission()
        if not hasattr(engine, "init_weight_transfer_engine"):
            raise AdminError(409, 'this vLLM has no weight-transfer engines: use trainer.weights.transport = "folder"')
        # Checked before any worker starts to join: with ranks beyond the group, one worker
        # would fail at once while the others wait out the timeout, still joining (the next
        # join's answer would then be theirs).
        parallel = app.state.vllm_config.parallel_config
        workers = parallel.world_size * parallel.data_parallel_size
        if not (1 <= req.rank and req.rank + workers <= req.world_size) or req.timeout_s <= 0:
            raise AdminError(
                400,
                f"the join gives this server's {workers} worker(s) ranks {req.rank}.."
                f"{req.rank + workers - 1} of a group of {req.world_size} (rank 0 is the trainer), "
                f"with timeout_s {req.timeout_s}: the ranks must be 1..{req.world_size - 1} and the "
                "timeout positive",
            )
        info = {
            "host": req.host,
            "port": req.port,
            "secret": req.secret,
            "rank_offset": req.rank,
            "world_size": req.world_size,
            "timeout_s": req.timeout_s,
        }
        async with swap_lock:
            self.joined = False
            try:
                await engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))
            except Exception as err:
                raise AdminError(
                    409,
                    f"could not join the trainer's transfer group at {req.host}:{req.port}: "
                    f"{type(err).__name__}: {err}",
                ) from None
            self.joined = True
        return {"joined": True}

    async def _receive_weights(self, app, engine, req: ReceiveWeights) -> ReceiveAnswer:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        gate, swap_lock = self._admission()
        step = req.step
        async with swap_lock:
            if not self.joined:
                raise AdminError(
                    409,
                    f"refused weights for step {step}: this server is in no trainer's transfer "
                    f"group (join it first: {serving.WEIGHTS_JOIN_ROUTE})",
                )
            t0 = time.monotonic()
            drained = await gate.close()  # requests in flight finish on the old weights
            waited = time.monotonic() - t0
            try:
                try:
                    await engine.start_weight_update()
                    await engine.update_weights(WeightTransferUpdateRequest(update_info={"step": step}))
                    await engine.finish_weight_update()
                    received = await engine.collective_rpc("primerl_received_weights")
                    if any(r is None or tuple(r)[:2] != tuple(received[0])[:2] for r in received):
                        raise ValueError(f"the workers did not all receive step {step} whole: {received}")
                except Exception as err:
                    self.joined = False  # the group's stream is out of step: join again
                    await self._fall_back(app, engine)
                    raise AdminError(
                        409,
                        f"weights of step {step} not received ({type(err).__name__}: {err}); "
                        f"serving {self._serving()} instead",
                    ) from None
                await _reset_prefix_cache(engine)
                _, checksum, size = received[0]
                self.weights = self.policy = Policy(step=step, path=None, checksum=checksum)
                await self._drop_policy_adapters(app)
            finally:
                await gate.open()
            return ReceiveAnswer(
                step=step,
                checksum=checksum,
                nbytes=sum(r[2] for r in received),
                drain_s=waited,
                drained=drained,
                swap_s=time.monotonic() - t0 - waited,
            )

    def _serving(self) -> str:
        p = self.weights
        return f"policy {p.step} ({p.path})" if p.path else "the weights it started with"

    async def _fall_back(self, app, engine) -> None:
        """After an update that did not arrive whole: reload the newest folder (the start's
        weights if none), since part of the update may be loaded already."""
        # worker.primerl_reload_weights, and vLLM's loader with no path: the model it was started on
        path = self.folder.path or app.state.vllm_config.model_config.model
        await engine.collective_rpc("primerl_reload_weights", kwargs={"weights_path": path})
        await _reset_prefix_cache(engine)
        self.weights = self.policy = self.folder
        await self._drop_policy_adapters(app)

    async def _load_lora(self, app, req: LoraLoad) -> LoraAnswer:
        # Through vLLM's own model registry, so that requests can then name the adapter as
        # their `model`.
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

        _, swap_lock = self._admission()
        name, path, step = req.name, req.path, req.step
        if not os.path.isdir(path):
            raise AdminError(400, f"LoRA adapter folder {path} does not exist")
        models = getattr(app.state, "openai_serving_models", None)
        if models is None:
            raise AdminError(
                409, "this server does not serve LoRA adapters (start it with inference.enable_lora = true)"
            )
        async with swap_lock:
            t0 = time.monotonic()
            checksum = None
            if step is not None or req.checksum is not None:
                # Checked before anything changes: a bad folder leaves the old policy serving.
                try:
                    meta = await asyncio.to_thread(verify, path, req.checksum)
                except ValueError as err:
                    raise AdminError(409, f"refused LoRA adapter {name!r} for step {step}: {err}") from None
                if format_of(meta) != ADAPTER:
                    raise AdminError(
                        409,
                        f"refused LoRA adapter {name!r}: {path} holds {format_of(meta)!r} "
                        f"weights, not an adapter (load those with {serving.LOAD_WEIGHTS_ROUTE})",
                    )
                checksum = meta["checksum"]
            if step is not None and self.weights.step not in (serving.BASE_STEP, 0):
                raise AdminError(
                    409,
                    f"refused LoRA adapter {name!r} for step {step}: this server serves the full "
                    f"weights of policy {self.weights.step} ({self.weights.path}), and a published "
                    "adapter applies to the base weights; load those first",
                )
            # The same name again is the same policy and content (adapter_name): replace it in place.
            again = step is not None and name in models.lora_requests
            result = await models.load_lora_adapter(
                LoadLoRAAdapterRequest(lora_name=name, lora_path=path, load_inplace=again)
            )
            if not isinstance(result, str):
                raise AdminError(400, f"vLLM refused LoRA adapter {name!r} from {path}: {result.error.message}")
            if step is not None:
                self.adapter_steps[name] = step
                self.policy = Policy(step=step, path=path, checksum=checksum, adapter=name)
            return LoraAnswer(name=name, path=path, step=step, load_s=time.monotonic() - t0)

    async def _unload_lora(self, app, req: LoraUnload) -> dict:
        from vllm.entrypoints.serve.lora.protocol import UnloadLoRAAdapterRequest

        _, swap_lock = self._admission()
        name = req.name
        models = getattr(app.state, "openai_serving_models", None)
        if models is None:
            raise AdminError(
                409, "this server does not serve LoRA adapters (start it with inference.enable_lora = true)"
            )
        async with swap_lock:
            result = await models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=name))
            if not isinstance(result, str):
                raise AdminError(404, f"cannot unload LoRA adapter {name!r}: {result.error.message}")
            self.adapter_steps.pop(name, None)
            if self.policy.adapter == name:  # the policy falls back to the served weights
                self.policy = self.weights
        return {"name": name, "unloaded": True}

    async def _drop_policy_adapters(self, app) -> None:
        """Unload the adapters loaded as policies (they adapted the weights just replaced)."""
        if not self.adapter_steps:
            return
        from vllm.entrypoints.serve.lora.protocol import UnloadLoRAAdapterRequest

        models = getattr(app.state, "openai_serving_models", None)
        for name in list(self.adapter_steps):
            if models is not None:  # an adapter vLLM no longer knows is gone already
                await models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=name))
            del self.adapter_steps[name]
