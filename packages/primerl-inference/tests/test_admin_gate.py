"""The admin middleware as plain ASGI: its token check, the gate that pause and weight swaps
close, and the policy-step header, without vLLM.

The middleware wraps a small ASGI app of ours (it records the generation requests it serves
and can hold one open until an asyncio.Event is set), and vLLM's engine client
(`scope["app"].state.engine_client`) is stood in for by an object that records the calls a
swap makes. Requests are raw ASGI scope/receive/send calls on one asyncio loop. The same
routes against a real vLLM server: tests/test_inference_server.py.
"""

import asyncio
import json
from types import SimpleNamespace

import pytest
from primerl_inference.admin import VLLM_LORA_ROUTES, AdminMiddleware, Gate
from primerl_inference.config import ADMIN_TOKEN_ENV
from primerl_protocol import serving
from primerl_protocol.weights import ADAPTER, ADAPTER_CONFIG, ADAPTER_WEIGHTS, write_marker

TOKEN = "s3cret-admin-token"
GENERATE = "/v1/completions"
TIMEOUT_S = 2.0  # every wait is bounded: a broken gate fails the test instead of hanging it
POLL_S = 0.001  # how often `until` looks again at the state it waits for

ADMIN_ROUTES = [
    ("POST", serving.LOAD_WEIGHTS_ROUTE),
    ("POST", serving.LORA_LOAD_ROUTE),
    ("POST", serving.LORA_UNLOAD_ROUTE),
    ("POST", serving.PAUSE_ROUTE),
    ("POST", serving.RESUME_ROUTE),
    ("GET", serving.POLICY_ROUTE),
    ("GET", serving.HEALTH_ROUTE),
    ("POST", serving.PAUSE_ROUTE + "/"),  # the trailing slash is the same route
]
LORA_ROUTES = [("POST", r) for r in sorted(VLLM_LORA_ROUTES)] + [("POST", sorted(VLLM_LORA_ROUTES)[0] + "/")]


class HoldingApp:
    """The app behind the middleware: answers 200 echoing the body; a request whose body names
    a `hold` in `holds` is kept open until that event is set."""

    def __init__(self) -> None:
        self.served: list[str] = []  # the `id` of each request, in the order it reached the app
        self.finished: list[str] = []
        self.holds: dict[str, asyncio.Event] = {}

    async def __call__(self, scope, receive, send) -> None:
        message = await receive()
        body = json.loads(message.get("body") or b"{}")
        rid = body.get("id", scope["path"])
        self.served.append(rid)
        if body.get("hold") is not None:
            await self.holds[body["hold"]].wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps({"id": rid}).encode()})
        self.finished.append(rid)

    def in_flight(self) -> int:
        return len(self.served) - len(self.finished)


class EngineStandIn:
    """Stands in for vLLM's engine client: records each call, with what the app had in flight."""

    def __init__(self, app: HoldingApp) -> None:
        self.app = app
        self.calls: list[tuple] = []
        self.reload_hold: asyncio.Event | None = None

    async def collective_rpc(self, method, kwargs=None):
        self.calls.append(("collective_rpc", method, kwargs, self.app.in_flight(), list(self.app.finished)))
        if self.reload_hold is not None:
            await self.reload_hold.wait()
        return [None]

    async def reset_prefix_cache(self, reset_running_requests=False):
        self.calls.append(("reset_prefix_cache", reset_running_requests, self.app.in_flight()))
        return True


class Server:
    """The middleware around a HoldingApp, driven by raw ASGI calls."""

    def __init__(self) -> None:
        self.app = HoldingApp()
        self.engine = EngineStandIn(self.app)
        self.state = SimpleNamespace(state=SimpleNamespace(engine_client=self.engine))
        self.mw = AdminMiddleware(self.app)

    async def request(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        token: str | None = None,
        authorization: bytes | None = None,
    ):
        headers = [(b"content-type", b"application/json")]
        if token is not None:
            headers.append((b"authorization", f"Bearer {token}".encode()))
        if authorization is not None:
            headers.append((b"authorization", authorization))
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "headers": headers,
            "app": self.state,
        }
        chunks = [
            {"type": "http.request", "body": json.dumps(body).encode() if body is not None else b"", "more_body": False}
        ]

        async def receive():
            if chunks:
                return chunks.pop(0)
            await asyncio.Event().wait()  # the client never disconnects

        sent = []

        async def send(message):
            sent.append(message)

        await self.mw(scope, receive, send)
        start = sent[0]
        assert start["type"] == "http.response.start"
        payload = b"".join(m.get("body", b"") for m in sent[1:])
        return start["status"], dict(start.get("headers", [])), json.loads(payload) if payload else None

    def start(self, *args, **kwargs) -> asyncio.Task:
        return asyncio.ensure_future(self.request(*args, **kwargs))

    async def generate(self, rid: str, hold: str | None = None):
        return await self.request("POST", GENERATE, {"id": rid, "hold": hold})

    def start_generate(self, rid: str, hold: str | None = None) -> asyncio.Task:
        return asyncio.ensure_future(self.generate(rid, hold))

    def hold(self, name: str) -> asyncio.Event:
        self.app.holds[name] = asyncio.Event()
        return self.app.holds[name]

    # The gate's counters (0 before the first request, which makes the gate): `closed` how many
    # closings (a swap, a pause) hold it shut, `held` the requests waiting at it, `active` those
    # admitted and still running.
    def closed(self) -> int:
        return self.mw.gate.closed if self.mw.gate is not None else 0

    def held(self) -> int:
        return self.mw.gate.held if self.mw.gate is not None else 0

    def active(self) -> int:
        return self.mw.gate.active if self.mw.gate is not None else 0

    async def admin(self, method: str, route: str, body: dict | None = None):
        return await asyncio.wait_for(self.request(method, route, body, token=TOKEN), TIMEOUT_S)


def step_of(headers: dict) -> int:
    return int(headers[serving.STEP_HEADER.encode()])


async def until(condition, what: str) -> None:
    """Wait until `condition()` is true (polled every POLL_S); fail naming `what` after TIMEOUT_S.

    Waits for the state a test needs, never for a guessed time: a loaded machine only makes it
    slower, not wrong."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + TIMEOUT_S
    while not condition():
        if loop.time() > deadline:
            pytest.fail(f"not reached within {TIMEOUT_S} s: {what}")
        await asyncio.sleep(POLL_S)


async def done(task: asyncio.Task):
    return await asyncio.wait_for(task, TIMEOUT_S)


@pytest.fixture
def token(monkeypatch):
    monkeypatch.setenv(ADMIN_TOKEN_ENV, TOKEN)


@pytest.fixture
def weights(tmp_path):
    """publish(step) -> a folder that primerl_protocol.weights.verify accepts."""

    def publish(step: int) -> str:
        folder = tmp_path / f"step_{step}"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(f"weights of step {step}".encode() * 64)
        write_marker(folder, step, ["model.safetensors"], created_at=0.0)
        return str(folder)

    return publish


# -- the token ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "configured, authorization",
    [
        (TOKEN, None),  # no Authorization header
        (TOKEN, b"Bearer wrong-token"),
        (TOKEN, TOKEN.encode()),  # the token without "Bearer "
        (TOKEN, b"Bearer " + TOKEN.encode() + b"x"),
        (None, None),  # no token configured: nobody gets in, whatever they send
        (None, b"Bearer "),
        (None, b"Bearer None"),
    ],
    ids=["none-sent", "wrong", "no-bearer", "longer", "unset-none-sent", "unset-empty", "unset-None"],
)
@pytest.mark.parametrize("method, path", ADMIN_ROUTES + LORA_ROUTES, ids=lambda v: v)
def test_admin_and_lora_routes_refuse_a_missing_or_wrong_token_engine_stood_in(
    monkeypatch, weights, configured, authorization, method, path
):
    if configured is None:
        monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    else:
        monkeypatch.setenv(ADMIN_TOKEN_ENV, configured)
    body = {"path": weights(1), "step": 1} if path == serving.LOAD_WEIGHTS_ROUTE else {"name": "a", "path": "/x"}

    async def main():
        server = Server()
        status, _, answer = await server.request(method, path, body, authorization=authorization)
        assert status == 401 and "bearer token" in answer["error"]
        # refused before anything happened: nothing reached vLLM, the gate is still open
        assert server.app.served == [] and server.engine.calls == []
        status, headers, _ = await asyncio.wait_for(server.generate("after"), TIMEOUT_S)
        assert status == 200 and step_of(headers) == serving.BASE_STEP

    asyncio.run(main())


def test_the_right_token_opens_the_admin_and_lora_routes_engine_stood_in(token):
    async def main():
        server = Server()
        status, _, health = await server.admin("GET", serving.HEALTH_ROUTE)
        assert status == 200 and health == {
            "ready": True,
            "paused": False,
            "step": serving.BASE_STEP,
            "in_flight": 0,
            "held": 0,
        }
        for route in sorted(VLLM_LORA_ROUTES):  # passed through to vLLM's own route
            status, _, answer = await server.admin("POST", route, {"id": route})
            assert status == 200 and answer == {"id": route}
        assert server.app.served == sorted(VLLM_LORA_ROUTES)

    asyncio.run(main())


# -- pause and resume -----------------------------------------------------------------------


def test_pause_holds_generation_requests_and_resume_releases_them_in_order_engine_stood_in(token):
    async def main():
        server = Server()
        status, _, answer = await server.admin("POST", serving.PAUSE_ROUTE)
        assert (status, answer) == (200, {"paused": True})
        # a second pause is the same pause: one resume must undo both
        status, _, answer = await server.admin("POST", serving.PAUSE_ROUTE)
        assert (status, answer) == (200, {"paused": True})
        _, _, health = await server.admin("GET", serving.HEALTH_ROUTE)
        assert health == {"ready": False, "paused": True, "step": serving.BASE_STEP, "in_flight": 0, "held": 0}

        tasks = []
        for i, rid in enumerate(["r1", "r2", "r3"], start=1):
            tasks.append(server.start_generate(rid))
            # each one is waiting at the gate before the next arrives
            await until(lambda: server.held() == i or tasks[-1].done(), f"{rid} waits at the closed gate ({i} held)")
        assert server.app.served == [] and not any(t.done() for t in tasks)
        _, _, health = await server.admin("GET", serving.HEALTH_ROUTE)
        assert (health["held"], health["in_flight"]) == (3, 0)

        status, _, answer = await server.admin("POST", serving.RESUME_ROUTE)
        assert (status, answer) == (200, {"paused": False})
        results = await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)
        assert [r[0] for r in results] == [200, 200, 200]
        assert server.app.served == ["r1", "r2", "r3"]
        # and the gate stays open
        assert (await done(server.start_generate("r4")))[0] == 200
        _, _, health = await server.admin("GET", serving.HEALTH_ROUTE)
        assert health == {"ready": True, "paused": False, "step": serving.BASE_STEP, "in_flight": 0, "held": 0}

    asyncio.run(main())


def test_get_requests_are_never_held_engine_stood_in(token, weights):
    async def main():
        server = Server()
        gets = ["/health", "/v1/models", "/metrics"]
        await server.admin("POST", serving.PAUSE_ROUTE)
        for path in gets:  # while paused
            status, headers, _ = await asyncio.wait_for(server.request("GET", path), TIMEOUT_S)
            assert status == 200
        await server.admin("POST", serving.RESUME_ROUTE)

        release = server.hold("a")
        in_flight = server.start_generate("a", hold="a")
        await until(lambda: server.app.in_flight() == 1 and server.active() == 1, '"a" is admitted and running')
        swap = server.start("POST", serving.LOAD_WEIGHTS_ROUTE, {"path": weights(1), "step": 1}, token=TOKEN)
        # past its checksum check, the swap has closed the gate and waits for "a"
        await until(lambda: server.closed() == 1 or swap.done(), "the swap closes the gate")
        assert server.mw.swap_lock.locked()
        assert not swap.done()  # the gate is closed, draining "a"
        for path in gets:  # while a swap drains
            status, _, _ = await asyncio.wait_for(server.request("GET", path), TIMEOUT_S)
            assert status == 200
        _, _, health = await server.admin("GET", serving.HEALTH_ROUTE)
        assert health["ready"] is False and health["step"] == serving.BASE_STEP
        assert (health["in_flight"], health["held"]) == (1, 0)  # "a" drains; nothing else asked
        release.set()
        assert (await done(swap))[0] == 200 and (await done(in_flight))[0] == 200
        assert server.app.served == [*gets, "a", *gets]

    asyncio.run(main())


# -- weight swaps ---------------------------------------------------------------------------


def test_a_swap_waits_for_the_requests_in_flight_before_reloading_engine_stood_in(token, weights):
    async def main():
        server = Server()
        path = weights(3)
        release = server.hold("old")
        in_flight = [server.start_generate("a", hold="old"), server.start_generate("b", hold="old")]
        await until(lambda: server.active() == 2 and len(server.app.served) == 2, '"a" and "b" are running')
        assert server.app.in_flight() == 2

        swap = server.start("POST", serving.LOAD_WEIGHTS_ROUTE, {"path": path, "step": 3}, token=TOKEN)
        # past its checksum check (in a thread), the swap has closed the gate: its drain has begun
        await until(lambda: server.closed() == 1 or swap.done(), "the swap closes the gate")
        assert not swap.done()
        late = server.start_generate("late")  # arrives while the swap drains: waits, not refused
        await until(lambda: server.held() == 1 or late.done(), '"late" waits at the closed gate')
        await asyncio.sleep(0.2)  # the drain lasts at least this long: drain_s is checked below
        assert not swap.done() and server.engine.calls == []  # no reload under requests in flight
        assert server.app.served == ["a", "b"]  # "late" is held at the closed gate

        release.set()
        status, _, answer = await done(swap)
        assert status == 200 and answer["step"] == 3 and answer["path"] == path
        assert answer["drained"] == 2  # it waited for "a" and "b"
        assert answer["drain_s"] >= 0.2  # for at least the 0.2 s they were held
        # the reload came when nothing was in flight and both old requests had finished; then the
        # prefix cache was dropped
        assert server.engine.calls == [
            ("collective_rpc", "primerl_reload_weights", {"weights_path": path}, 0, ["a", "b"]),
            ("reset_prefix_cache", False, 0),
        ]
        assert [step_of((await done(t))[1]) for t in in_flight] == [serving.BASE_STEP, serving.BASE_STEP]
        assert step_of((await done(late))[1]) == 3
        assert server.app.served == ["a", "b", "late"]

    asyncio.run(main())


def test_a_swap_with_nothing_in_flight_does_not_wait_engine_stood_in(token, weights):
    class Boom(Exception):
        pass

    async def main():
        server = Server()
        # requests that finished, and one whose app raised, leave nothing in flight behind them
        assert (await server.generate("done"))[0] == 200
        inner = server.mw.app

        async def failing(scope, receive, send):
            raise Boom("the engine failed this request")

        server.mw.app = failing
        with pytest.raises(Boom):
            await server.generate("raised")
        server.mw.app = inner

        status, _, answer = await server.admin("POST", serving.LOAD_WEIGHTS_ROUTE, {"path": weights(1), "step": 1})
        assert status == 200
        assert answer["drained"] == 0  # nothing was in flight to wait for
        assert [c[0] for c in server.engine.calls] == ["collective_rpc", "reset_prefix_cache"]

    asyncio.run(main())


def test_a_pause_inside_a_swap_nests_engine_stood_in(token, weights):
    """Whichever of a pause and a swap ends first, the gate opens only when both have ended."""

    async def main():
        server = Server()
        # 1. pause during a swap's drain; the swap ends first: still paused
        release = server.hold("a")
        in_flight = server.start_generate("a", hold="a")
        await until(lambda: server.app.in_flight() == 1 and server.active() == 1, '"a" is admitted and running')
        swap = server.start("POST", serving.LOAD_WEIGHTS_ROUTE, {"path": weights(1), "step": 1}, token=TOKEN)
        await until(lambda: server.closed() == 1 or swap.done(), "the swap closes the gate and drains")
        assert not swap.done()
        pause = server.start("POST", serving.PAUSE_ROUTE, token=TOKEN)
        await until(lambda: server.closed() == 2 or pause.done(), "the pause closes the gate inside the swap's")
        assert not swap.done() and not pause.done()  # both wait for "a"
        release.set()
        assert (await done(swap))[0] == 200 and (await done(pause))[0] == 200
        assert (await done(in_flight))[0] == 200
        held = server.start_generate("b")
        await until(lambda: server.held() == 1 or held.done(), '"b" waits at the gate the pause keeps closed')
        assert server.closed() == 1  # the pause's closing is left
        assert not held.done() and server.app.served == ["a"]  # the swap reopened only its own closing
        await server.admin("POST", serving.RESUME_ROUTE)
        status, headers, _ = await done(held)
        assert status == 200 and step_of(headers) == 1

        # 2. a swap during a pause, resumed while the weights load: the swap ends last
        await server.admin("POST", serving.PAUSE_ROUTE)
        server.engine.reload_hold = asyncio.Event()
        swap = server.start("POST", serving.LOAD_WEIGHTS_ROUTE, {"path": weights(2), "step": 2}, token=TOKEN)
        await until(lambda: len(server.engine.calls) >= 3 or swap.done(), "the swap calls the reload")
        assert len(server.engine.calls) == 3  # reloading now (no drain: nothing in flight)
        assert server.engine.calls[2][:2] == ("collective_rpc", "primerl_reload_weights")
        await server.admin("POST", serving.RESUME_ROUTE)
        assert server.closed() == 1  # the resume undid the pause's closing only
        held = server.start_generate("c")
        await until(lambda: server.held() == 1 or held.done(), '"c" waits at the gate the swap keeps closed')
        assert not held.done() and server.app.served == ["a", "b"]  # the swap still holds the gate
        server.engine.reload_hold.set()
        assert (await done(swap))[0] == 200
        status, headers, _ = await done(held)
        assert status == 200 and step_of(headers) == 2
        _, _, health = await server.admin("GET", serving.HEALTH_ROUTE)
        assert health == {"ready": True, "paused": False, "step": 2, "in_flight": 0, "held": 0}

    asyncio.run(main())


def test_a_close_cancelled_while_it_drains_reopens_the_gate():
    """The gate alone: a close() cancelled while a request drains leaves the gate open."""

    async def main():
        gate = Gate()
        await gate.enter()  # one request in flight
        closing = asyncio.ensure_future(gate.close())
        await until(lambda: gate.closed == 1, "close() shuts the gate and drains")
        waiting = asyncio.ensure_future(gate.enter())
        await until(lambda: gate.held == 1, "a request waits at the closed gate")
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        await done(waiting)  # admitted: the gate is open again
        assert (gate.closed, gate.active, gate.held) == (0, 2, 0)
        await gate.leave()
        await gate.leave()
        assert await done(asyncio.ensure_future(gate.close())) == 0  # and it still closes

    asyncio.run(main())


def test_a_request_cancelled_while_it_leaves_is_counted_out():
    """The gate alone: a request whose leave() is cancelled while it waits for the gate's lock
    (its connection dropped twice) is still counted out, so the next close() drains."""

    async def main():
        gate = Gate()
        await gate.enter()
        await gate.cond.acquire()  # someone else holds the lock
        leaving = asyncio.ensure_future(gate.leave())
        await asyncio.sleep(0.05)
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        gate.cond.release()
        assert gate.active == 0
        assert await done(asyncio.ensure_future(gate.close())) == 0

    asyncio.run(main())


def test_a_swap_cancelled_while_it_drains_reopens_the_gate_engine_stood_in(token, weights):
    async def main():
        server = Server()
        release = server.hold("a")
        in_flight = server.start_generate("a", hold="a")
        await until(lambda: server.app.in_flight() == 1 and server.active() == 1, '"a" is admitted and running')
        swap = server.start("POST", serving.LOAD_WEIGHTS_ROUTE, {"path": weights(1), "step": 1}, token=TOKEN)
        await until(lambda: server.closed() == 1 or swap.done(), "the swap closes the gate and drains")
        late = server.start_generate("late")
        await until(lambda: server.held() == 1 or late.done(), '"late" waits at the closed gate')
        swap.cancel()  # the server cancels the admin request while it drains "a"
        with pytest.raises(asyncio.CancelledError):
            await swap
        status, headers, _ = await done(late)  # admitted on the old weights, "a" still running
        assert status == 200 and step_of(headers) == serving.BASE_STEP
        assert server.closed() == 0 and not server.mw.swap_lock.locked() and server.engine.calls == []
        release.set()
        assert (await done(in_flight))[0] == 200
        status, _, answer = await server.admin("POST", serving.LOAD_WEIGHTS_ROUTE, {"path": weights(2), "step": 2})
        assert status == 200 and answer["drained"] == 0  # the next swap closes and reopens as usual
        assert step_of((await server.generate("after"))[1]) == 2

    asyncio.run(main())


def test_a_pause_cancelled_while_it_drains_holds_until_resumed_engine_stood_in(token):
    async def main():
        server = Server()
        release = server.hold("a")
        in_flight = server.start_generate("a", hold="a")
        await until(lambda: server.app.in_flight() == 1 and server.active() == 1, '"a" is admitted and running')
        pause = server.start("POST", serving.PAUSE_ROUTE, token=TOKEN)
        await until(lambda: server.closed() == 1 or pause.done(), "the pause closes the gate and drains")
        pause.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pause
        held = server.start_generate("b")
        await until(lambda: server.held() == 1 or held.done(), '"b" waits at the gate the pause closed')
        release.set()
        assert (await done(in_flight))[0] == 200
        _, _, health = await server.admin("GET", serving.HEALTH_ROUTE)
        assert health == {"ready": False, "paused": True, "step": serving.BASE_STEP, "in_flight": 0, "held": 1}
        assert server.closed() == 1 and not held.done()  # paused it is, until the resume
        await server.admin("POST", serving.RESUME_ROUTE)
        assert (await done(held))[0] == 200 and server.closed() == 0

    asyncio.run(main())


def test_every_generation_response_carries_the_step_of_its_policy_engine_stood_in(token, weights):
    async def main():
        server = Server()
        status, headers, _ = await server.generate("before")
        assert status == 200 and step_of(headers) == serving.BASE_STEP
        assert headers[b"content-type"] == b"application/json"  # the app's own headers are kept

        await server.admin("POST", serving.LOAD_WEIGHTS_ROUTE, {"path": weights(4), "step": 4})
        assert step_of((await server.generate("after 4"))[1]) == 4

        # admitted during the next swap (it waited at the gate): produced by, and labelled with,
        # the new policy, not the one serving when it arrived
        release = server.hold("x")
        in_flight = server.start_generate("in flight", hold="x")
        await until(lambda: server.app.in_flight() == 1 and server.active() == 1, '"in flight" is running')
        path9 = weights(9)
        swap = server.start("POST", serving.LOAD_WEIGHTS_ROUTE, {"path": path9, "step": 9}, token=TOKEN)
        await until(lambda: server.closed() == 1 or swap.done(), "the swap closes the gate")
        assert not swap.done()
        waiting = server.start_generate("waited")
        await until(lambda: server.held() == 1 or waiting.done(), '"waited" waits at the closed gate')
        assert not waiting.done() and server.app.served == ["before", "after 4", "in flight"]  # not admitted yet
        release.set()
        await done(swap)
        assert step_of((await done(in_flight))[1]) == 4
        assert step_of((await done(waiting))[1]) == 9
        _, _, policy = await server.admin("GET", serving.POLICY_ROUTE)
        assert (policy["step"], policy["path"], policy["paused"]) == (9, path9, False)

    asyncio.run(main())


# -- adapters as policies -------------------------------------------------------------------


class ModelsStandIn:
    """Stands in for vLLM's model registry (`app.state.openai_serving_models`): records the
    adapters loaded and unloaded; the real one answers in tests/test_inference_server.py."""

    def __init__(self) -> None:
        self.lora_requests: dict[str, str] = {}
        self.calls: list[tuple] = []

    async def load_lora_adapter(self, request):
        self.calls.append(("load", request.lora_name, request.lora_path, request.load_inplace))
        self.lora_requests[request.lora_name] = request.lora_path
        return "Success"

    async def unload_lora_adapter(self, request):
        self.calls.append(("unload", request.lora_name))
        self.lora_requests.pop(request.lora_name)
        return "Success"


@pytest.fixture
def adapters(tmp_path):
    """publish(step) -> a folder of a published adapter (fake bytes; the marker is real)."""

    def publish(step: int) -> tuple[str, str]:
        folder = tmp_path / f"adapter_{step}"
        folder.mkdir()
        for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            (folder / name).write_bytes(f"{name} of step {step}".encode() * 16)
        return str(folder), write_marker(folder, step, [ADAPTER_CONFIG, ADAPTER_WEIGHTS], 0.0, format=ADAPTER)

    return publish


def test_a_published_adapter_becomes_the_policy_and_each_request_carries_its_adapters_step_engine_stood_in(
    token, weights, adapters
):
    """A LoraLoad with a step: the checksum verified, the adapter loaded under its name and
    reported as the policy, no gate closed. A request naming an adapter carries that adapter's
    step (an older one's too: requests in flight on it keep it), one naming the base model the
    weights' step. A wrong checksum or a full-weights folder is refused with 409, the policy
    unchanged; a weight swap drops the policy adapters."""
    import vllm.entrypoints.serve.lora.protocol  # noqa: F401  (the routes import it; seconds, outside TIMEOUT_S)

    async def main():
        server = Server()
        models = server.state.state.openai_serving_models = ModelsStandIn()

        async def step_for(model: str) -> int:
            status, headers, _ = await done(server.start("POST", GENERATE, {"id": model, "model": model}))
            assert status == 200
            return step_of(headers)

        path3, digest3 = adapters(3)
        status, _, answer = await server.admin(
            "POST", serving.LORA_LOAD_ROUTE, {"name": "policy-3", "path": path3, "step": 3, "checksum": digest3}
        )
        assert status == 200 and (answer["name"], answer["step"]) == ("policy-3", 3)
        _, _, policy = await server.admin("GET", serving.POLICY_ROUTE)
        assert (policy["step"], policy["adapter"], policy["checksum"], policy["path"]) == (
            3,
            "policy-3",
            digest3,
            path3,
        )
        assert server.closed() == 0 and server.engine.calls == []  # no gate closed, no weights reloaded
        assert await step_for("policy-3") == 3 and await step_for("base") == serving.BASE_STEP
        assert server.app.served[-2:] == ["policy-3", "base"]  # the body read for the step reached the app whole

        path4, digest4 = adapters(4)
        await server.admin("POST", serving.LORA_LOAD_ROUTE, {"name": "policy-4", "path": path4, "step": 4})
        assert await step_for("policy-3") == 3 and await step_for("policy-4") == 4

        # refused before anything changed: a checksum that does not match, a full-weights folder
        path5, _ = adapters(5)
        status, _, answer = await server.admin(
            "POST", serving.LORA_LOAD_ROUTE, {"name": "policy-5", "path": path5, "step": 5, "checksum": "0" * 32}
        )
        assert status == 409 and "refused LoRA adapter 'policy-5' for step 5" in answer["error"]
        assert "is not the expected" in answer["error"]
        status, _, answer = await server.admin(
            "POST", serving.LORA_LOAD_ROUTE, {"name": "policy-6", "path": weights(6), "step": 6}
        )
        assert status == 409 and "holds 'hf-safetensors' weights, not an adapter" in answer["error"]
        _, _, policy = await server.admin("GET", serving.POLICY_ROUTE)
        assert (policy["step"], policy["adapter"]) == (4, "policy-4") and sorted(models.lora_requests) == [
            "policy-3",
            "policy-4",
        ]

        # the same name again (the same policy and content) is reloaded in place
        await server.admin("POST", serving.LORA_LOAD_ROUTE, {"name": "policy-4", "path": path4, "step": 4})
        assert models.calls[-1] == ("load", "policy-4", path4, True)

        # unloading the older adapter leaves the policy; a weight swap drops the rest
        await server.admin("POST", serving.LORA_UNLOAD_ROUTE, {"name": "policy-3"})
        assert await step_for("policy-4") == 4 and await step_for("policy-3") == serving.BASE_STEP
        await server.admin("POST", serving.LOAD_WEIGHTS_ROUTE, {"path": weights(7), "step": 7})
        assert models.lora_requests == {} and await step_for("policy-4") == 7
        _, _, policy = await server.admin("GET", serving.POLICY_ROUTE)
        assert (policy["step"], policy["adapter"]) == (7, None)
        # an adapter applies to the base weights: on a published full-weights policy it is refused
        status, _, answer = await server.admin(
            "POST", serving.LORA_LOAD_ROUTE, {"name": "policy-8", "path": adapters(8)[0], "step": 8}
        )
        assert status == 409 and "serves the full weights of policy 7" in answer["error"]

    asyncio.run(main())
