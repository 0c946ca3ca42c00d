"""Parts of the orchestrator that need no inference server: pass@k, batch building, the
start rule of the off-policy bound, routing and health probes (against real HTTP sockets)."""

import asyncio
import contextlib
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
from primerl_orchestrator.batching import Group, build_step
from primerl_orchestrator.config import OrchestratorConfig
from primerl_orchestrator.evals import pass_at_k, score_tasks
from primerl_orchestrator.generate import is_model_error
from primerl_orchestrator.loop import Orchestrator
from primerl_orchestrator.servers import NoServerError, ServerPool
from primerl_orchestrator.testing import garbage_server
from primerl_protocol.rollouts import Rollout, Turn


def test_pass_at_k_by_hand():
    # n = 5 rollouts, c = 2 correct: P(no correct among 2 drawn) = C(3,2)/C(5,2) = 3/10
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)  # = c / n
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 1, 4) == 1.0  # n = k: any correct rollout passes
    assert pass_at_k(5, 3, 3) == 1.0  # fewer wrong ones (2) than draws (3)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(3, 1, 4)


def test_avg_and_pass_over_tasks_by_hand():
    # task A: rewards 1, 0 (one solved); task B: 0.5, 0.5 (none reaches the threshold 1)
    scores = score_tasks([[1.0, 0.0], [0.5, 0.5]], k=2, threshold=1.0)
    assert scores["avg@2"] == pytest.approx((0.5 + 0.5) / 2)
    assert scores["pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert scores["pass@2"] == pytest.approx((1.0 + 0.0) / 2)


def test_model_errors_are_told_from_environment_errors():
    assert is_model_error("ProviderError: Connection refused")
    assert is_model_error("TaskError: reward exploded; InterceptionError: closed")
    assert not is_model_error("TaskError: reward function exploded")
    assert not is_model_error(None)


def rollout(sample_id, group_id, reward, policy_step=0, error=None, prompt=(1, 2, 3), completion=(4, 5)):
    turns = [
        Turn(prompt_ids=list(prompt), completion_ids=list(completion), completion_logprobs=[-0.5] * len(completion))
    ]
    return Rollout(
        sample_id=sample_id,
        group_id=group_id,
        turns=turns,
        reward=reward,
        policy_step=policy_step,
        error=error,
        env="toy",
    )


def test_build_step_advantages_filters_and_metrics():
    cfg = OrchestratorConfig(batch_size=6, group_size=3)
    groups = [
        Group(0, "toy", 0, [rollout(0, 0, 1.0, 4), rollout(1, 0, 0.0, 4), rollout(2, 0, 0.5, 3, error="TaskError: x")]),
        Group(1, "toy", 1, [rollout(3, 1, 0.5, 5), rollout(4, 1, 0.5, 5), rollout(5, 1, 0.5, 5)]),  # all equal
    ]
    batches, m = build_step(5, groups, cfg, seq_len=16, num_ranks=2)
    assert [b.rank for b in batches] == [0, 1] and all(b.step == 5 for b in batches)
    trained = {
        int(i): float(mb.advantages[start])
        for b in batches
        for mb in b.micro_batches
        for i, start in zip(mb.sample_ids, mb.cu_seqlens()[:-1])
        if i >= 0
    }
    # group 0 without the errored rollout: rewards 1, 0 -> grpo advantages +1, -1
    assert trained == pytest.approx({0: 1.0, 1: -1.0}, abs=1e-4)
    assert m["filter/errored"] == 1 and m["filter/zero_advantage"] == 3
    assert m["reward/mean"] == pytest.approx((1.0 + 0.0 + 0.5 * 3) / 5)  # errored rollouts excluded
    assert m["rollouts/error_rate"] == pytest.approx(1 / 6)
    assert m["off_policy/max"] == 1.0 and m["off_policy/mean"] == 1.0  # step 5, policy 4
    assert batches[0].num_loss_tokens == 4 and m["batch/loss_tokens"] == 4


def test_a_step_with_nothing_to_train_still_gets_padding_batches():
    cfg = OrchestratorConfig(batch_size=2, group_size=2)
    batches, m = build_step(
        0, [Group(0, "toy", 0, [rollout(0, 0, 1.0), rollout(1, 0, 1.0)])], cfg, seq_len=16, num_ranks=2
    )
    assert len(batches) == 2 and m["batch/samples"] == 0
    for b in batches:
        (mb,) = b.micro_batches
        assert not mb.loss_mask.any() and list(mb.sample_ids) == [-1]


def test_samples_longer_than_a_row_are_dropped_and_counted():
    cfg = OrchestratorConfig(batch_size=2, group_size=2)
    long = rollout(1, 0, 0.0, completion=tuple(range(4, 30)))
    _, m = build_step(0, [Group(0, "toy", 0, [rollout(0, 0, 1.0), long])], cfg, seq_len=16, num_ranks=1)
    assert m["filter/longer_than_row"] == 1 and m["batch/samples"] == 1


def orchestrator(k, batch_size=8, group_size=4, max_steps=None, max_in_flight=512):
    cfg = SimpleNamespace(
        orchestrator=OrchestratorConfig(
            batch_size=batch_size, group_size=group_size, max_async_level=k, max_in_flight=max_in_flight
        ),
        run_dir="/nonexistent",
        max_steps=max_steps,
    )
    return Orchestrator(cfg)


def start_all(orch) -> int:
    """Start groups (as placeholders) while the rule allows; how many started."""
    n = 0
    while orch.may_start():
        orch.running[n + 1000 * len(orch.done)] = Group(n, "toy", n)
        orch.in_flight += orch.G
        n += 1
    return n


def test_start_rule_k0_is_synchronous_and_k_allows_k_batches_ahead():
    # 2 groups per batch. k = 0: only step 0's groups start on policy 0.
    assert start_all(orchestrator(k=0)) == 2
    # k = 2: steps 0, 1, 2 may all come from policy 0
    assert start_all(orchestrator(k=2)) == 6
    # building step 3 while the servers still serve policy 0, k = 2: nothing may start
    o = orchestrator(k=2)
    o.step = 3
    assert start_all(o) == 0
    o.version = 1  # policy 1 may feed steps up to 3
    assert start_all(o) == 2
    o.version = None  # waiting for a resumed trainer's weights
    assert not o.may_start()


def test_start_rule_respects_max_steps_and_in_flight():
    assert start_all(orchestrator(k=4, max_steps=2)) == 4  # no groups for step 2
    assert start_all(orchestrator(k=4, max_in_flight=12)) == 3  # 3 groups x 4 rollouts


@pytest.fixture
def garbage():
    with garbage_server() as url:
        yield url


def test_probes_name_what_is_wrong_and_no_healthy_server_is_an_error(garbage):
    async def go():
        pool = ServerPool([garbage, "http://127.0.0.1:9"], "m", "t", probe_timeout_s=2)
        with pytest.raises(NoServerError) as err:
            await pool.start()
        await pool.close()
        return str(err.value), pool

    message, pool = asyncio.run(go())
    assert "not a model list" in message and "ConnectError" in message
    assert [s.healthy for s in pool.servers] == [False, False]


def test_least_loaded_routing():
    pool = ServerPool(["http://a", "http://b", "http://c"], "m", "t")
    a, b, c = pool.servers
    a.in_flight, b.in_flight, c.in_flight = 3, 1, 2
    assert pool.pick() is b
    b.healthy = False
    assert pool.pick() is c
    c.in_flight = 3
    c.rollouts, a.rollouts = 10, 5  # a tie in flight goes to the one that has had fewer
    assert pool.pick() is a

    async def lease_two():
        async with pool.lease() as first:
            async with pool.lease() as second:
                return first, second, first.in_flight

    first, second, during = asyncio.run(lease_two())
    assert (first, second) == (a, c) and during == 4 and a.in_flight == 3


class _StandInServer(BaseHTTPRequestHandler):
    """A stand-in for a primerl server in vLLM's default logprobs mode (real HTTP; the
    real servers' report of their mode is checked against vLLM in test_inference_server)."""

    mode = "raw_logprobs"
    policy = None
    """What /admin/policy answers (None: a well-formed answer in `mode`)."""

    def do_GET(self):
        policy = self.policy if self.policy is not None else {"step": -1, "logprobs_mode": self.mode}
        payload = {"/health": {}, "/v1/models": {"data": [{"id": "m"}]}, "/admin/policy": policy}.get(self.path)
        body = json.dumps(payload).encode()
        self.send_response(200 if payload is not None else 404)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def stand_in(handler):
    """A stand-in HTTP server answering with `handler` on a free port; its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


async def start_pool(url: str, mode: str | None) -> None:
    """Start (and close) a pool of the one server at `url`, checking `mode` as logprobs mode."""
    pool = ServerPool([url], "m", "t", logprobs_mode=mode)
    try:
        await pool.start()
    finally:
        await pool.close()


def test_a_server_whose_logprobs_ignore_the_temperature_is_refused():
    with stand_in(_StandInServer) as url:
        with pytest.raises(NoServerError, match=r"'raw_logprobs' mode, not 'processed_logprobs'.*--logprobs-mode"):
            asyncio.run(start_pool(url, "processed_logprobs"))
        asyncio.run(start_pool(url, None))  # evals do not check it


@pytest.mark.parametrize(
    "policy, shown",
    [
        ({"step": "3", "logprobs_mode": "processed_logprobs"}, r"Expected `int`, got `str` - at `\$.step`"),
        ({"logprobs_mode": "processed_logprobs"}, r"missing required field `step`"),
        ([1, 2], r"Expected `object`, got `array`"),
        ({"step": 0, "logprobs_mode": "processed_logprobs", "extra": {"deep": [1] * 3}}, r"unknown field `extra`"),
    ],
)
def test_a_server_whose_policy_answer_is_malformed_is_refused_naming_the_route(policy, shown):
    """A server's answer is input from outside: one that does not decode as the admin
    contract's PolicyAnswer makes that server unhealthy, saying what was wrong, and the pool
    raises its clear NoServerError (nothing else escapes)."""
    with stand_in(type("Garbage", (_StandInServer,), {"policy": policy})) as url:
        with pytest.raises(
            NoServerError, match=rf"/admin/policy answered something that is not a PolicyAnswer \(.*{shown}"
        ):
            asyncio.run(start_pool(url, "processed_logprobs"))


def test_sampling_that_the_trainer_cannot_score_is_refused_at_config_load():
    from primerl_protocol.config import ConfigError, validate

    def load(sampling):
        return validate(OrchestratorConfig, {"sampling": sampling})

    with pytest.raises(ConfigError, match=r"`sampling`.*temperature 0 \(greedy\) cannot train"):
        load({"temperature": 0.0})
    for key, value in [("top_p", 0.9), ("top_k", 20), ("min_p", 0.05)]:
        with pytest.raises(ConfigError, match=rf"{key} = {value}: truncated sampling is not supported for RL"):
            load({key: value})
    cfg = load({"temperature": 0.7})
    assert cfg.sampling.request() == {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "min_p": 0.0}


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _start(urls: list[str], model: str = "m", wait_s: float = 600.0) -> float:
    """Seconds ServerPool.start(wait_s=...) took (it raises what start raises)."""
    pool = ServerPool(urls, model, "t")
    t0 = time.monotonic()
    try:
        await pool.start(wait_s=wait_s)
        return time.monotonic() - t0
    finally:
        await pool.close()


def test_the_pool_waits_for_a_server_that_is_still_starting_and_only_for_that():
    """ServerPool.start(wait_s): nothing listening yet is a server still starting (vLLM
    loading), so the pool probes again until it serves; a server that answers wrongly fails at
    once however long the wait; nothing ever listening fails after wait_s, saying why."""
    port = _unused_port()
    url = f"http://127.0.0.1:{port}"
    servers = []

    def come_up_late():
        time.sleep(1.5)
        server = ThreadingHTTPServer(("127.0.0.1", port), _StandInServer)
        servers.append(server)
        server.serve_forever()

    threading.Thread(target=come_up_late, daemon=True).start()
    try:
        assert asyncio.run(_start([url])) >= 1.4
        t0 = time.monotonic()
        with pytest.raises(NoServerError, match=r"serves \['m'\], not 'other'"):
            asyncio.run(_start([url], model="other"))
        assert time.monotonic() - t0 < 60  # not the 600 s allowed: a wrong server is not a slow one
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
    nobody = f"http://127.0.0.1:{_unused_port()}"
    with pytest.raises(NoServerError, match=rf"{nobody}: ConnectError"):
        asyncio.run(_start([nobody], wait_s=1.0))


class _AdapterServer(BaseHTTPRequestHandler):
    """A stand-in for a primerl server with LoRA on: it loads and unloads adapters (recording
    each admin POST in `posts`) and its policy route reports the last adapter loaded as a
    policy. The real servers: test_orchestrator_on_vllm.py."""

    posts: list = []
    policy: dict = {}

    def do_GET(self):
        payload = {
            "/health": {},
            "/v1/models": {"data": [{"id": "m"}]},
            "/admin/policy": {"logprobs_mode": "processed_logprobs", **self.policy},
        }.get(self.path)
        self._answer(payload)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        type(self).posts.append((self.path, body))
        if self.path == "/admin/lora/load" and body.get("step") is not None:
            type(self).policy = {"step": body["step"], "adapter": body["name"], "checksum": body["checksum"]}
        self._answer({})

    def _answer(self, payload):
        data = json.dumps(payload).encode()
        self.send_response(200 if payload is not None else 404)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_adapter_policies_are_loaded_named_by_rollouts_and_unloaded_once_idle():
    """Each policy is an adapter of its own name (version and checksum); a rollout names the
    adapter its server served when it started, to its end; an older adapter is unloaded once
    the last rollout on it ends (at once when none runs), never while one does."""
    from primerl_orchestrator.generate import Generator
    from primerl_protocol.serving import adapter_name
    from primerl_protocol.weights import ADAPTER

    handler = type("Adapters", (_AdapterServer,), {"posts": [], "policy": {"step": -1}})

    async def go(url):
        pool = ServerPool([url], "m", "t", logprobs_mode="processed_logprobs")
        gen = Generator(pool, "m", "tok")
        try:
            await pool.start()
            server = pool.servers[0]
            assert server.model == "m"  # the base weights: requests name the base model
            names = {v: adapter_name(v, f"{v:032x}") for v in (1, 2, 3)}
            await pool.load_weights("/w/step_0", 1, f"{1:032x}", ADAPTER)
            assert handler.posts[-1] == (
                "/admin/lora/load",
                {"name": names[1], "path": "/w/step_0", "step": 1, "checksum": f"{1:032x}"},
            )
            async with pool.lease() as leased:
                assert (leased.version, leased.model) == (1, names[1])
                assert gen.context(leased.url, 24, {"temperature": 1.0}, leased.model).model == names[1]
                await pool.load_weights("/w/step_1", 2, f"{2:032x}", ADAPTER)
                assert server.model == names[2] and server.adapters == {1: names[1], 2: names[2]}
                assert not any(path == "/admin/lora/unload" for path, _ in handler.posts)  # policy 1 still runs
            for _ in range(200):  # the lease's end unloads it, in a task of its own
                if handler.posts[-1][0] == "/admin/lora/unload":
                    break
                await asyncio.sleep(0.01)
            assert handler.posts[-1] == ("/admin/lora/unload", {"name": names[1]}) and server.adapters == {2: names[2]}
            assert gen.context(server.url, 24, {"temperature": 1.0}, server.model).model == names[2]
            await pool.load_weights("/w/step_2", 3, f"{3:032x}", ADAPTER)  # nothing runs on 2: unloaded at once
            assert [p for p, _ in handler.posts[-2:]] == ["/admin/lora/load", "/admin/lora/unload"]
            assert handler.posts[-1][1] == {"name": names[2]} and server.adapters == {3: names[3]}
            # the server's own answer is what counts: a probe finds it serving policy 3's adapter
            assert await pool.probe(server) is None and server.model == names[3]
        finally:
            await pool.close()

    with stand_in(handler) as url:
        asyncio.run(go(url))


class _ClosingServer(_AdapterServer):
    """A stand-in that keeps connections alive as vLLM's uvicorn does (HTTP/1.1) and closes one
    idle for `idle_close_s`: a request that arrives on it then crossed the close and gets no
    answer (the race an eval lost its server to, ReadError)."""

    protocol_version = "HTTP/1.1"
    idle_close_s = 5.0
    dropped = 0

    def handle_one_request(self):
        last = getattr(self, "_last", None)
        self.raw_requestline = self.rfile.readline(65537)
        if not self.raw_requestline:
            self.close_connection = True
            return
        if last is not None and time.monotonic() - last >= self.idle_close_s:
            type(self).dropped += 1
            self.close_connection = True
            return
        if self.parse_request():
            getattr(self, "do_" + self.command)()
            self.wfile.flush()
        self._last = time.monotonic()


def test_a_request_after_the_servers_keep_alive_timeout_goes_out_on_a_fresh_connection():
    """vLLM's server closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s); its clock
    starts before the client's (the answer is still crossing) and a request reaches it after
    the client sent it, up to ~1 s later on a loaded machine: the stand-in closes at 5 - 1 s
    of idle, the client idles 4 s. The pool's request then goes out on a new connection, never
    on the one the server is closing (with httpx's default 5 s it went out on it: ReadError)."""
    import vllm.envs
    from primerl_protocol.weights import ADAPTER

    lag = 1.0
    idle = float(vllm.envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE) - lag
    handler = type("Closing", (_ClosingServer,), {"posts": [], "policy": {"step": -1}, "idle_close_s": idle})

    async def go(url):
        pool = ServerPool([url], "m", "t", logprobs_mode="processed_logprobs")
        try:
            await pool.start()
            await asyncio.sleep(idle)
            await pool.load_weights("/w/step_0", 1, f"{1:032x}", ADAPTER)
            assert pool.servers[0].healthy, pool.servers[0].problem
            assert handler.posts[-1][0] == "/admin/lora/load" and handler.dropped == 0
        finally:
            await pool.close()

    with stand_in(handler) as url:
        asyncio.run(go(url))


class _MemoryServer(_AdapterServer):
    """A stand-in that takes weights in memory (records each admin POST; its policy route reports
    the last step it received or loaded). The real servers: test_inference_server.py and
    test_rl_run.py's runs with trainer.weights.transport = "memory"."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        type(self).posts.append((self.path, body))
        if self.path in ("/admin/weights/receive", "/admin/load_weights"):
            type(self).policy = {"step": body["step"]}
        self._answer({})


def test_weights_in_memory_are_received_by_the_servers_sent_to_and_only_then():
    """PolicyReady(format "memory"): each server the trainer sends to receives, healthy or not
    (the trainer's stream waits for it), and one that was unhealthy serves again; a server left
    out loads the step's folder if there is one, else gets no rollouts; a later probe never asks
    for a stream that is not coming."""
    from primerl_protocol.weights import MEMORY

    handlers = [type(f"Memory{i}", (_MemoryServer,), {"posts": [], "policy": {"step": -1}}) for i in range(3)]

    async def go(urls):
        pool = ServerPool(urls, "m", "t", logprobs_mode="processed_logprobs")
        try:
            await pool.start()
            a, b, c = pool.servers
            pool.mark_unhealthy(c, "a rollout failed")
            await pool.load_weights("", 1, "", MEMORY, served=[a.url, c.url + "/"])
            assert handlers[0].posts == [("/admin/weights/receive", {"step": 1})]
            assert handlers[2].posts == [("/admin/weights/receive", {"step": 1})]
            assert handlers[1].posts == []  # left out, and no folder to load
            assert (a.healthy, a.version, c.healthy, c.version) == (True, 1, True, 1)
            assert not b.healthy and "no folder of it" in b.problem
            # a probe asks for no stream (none is coming), not even of a server sent to before
            # that restarted since: without a folder to load, it waits for the next policy
            assert "no folder of it" in await pool.probe(b)
            handlers[0].policy = {"step": -1}
            assert "no folder of it" in await pool.probe(a)
            assert handlers[1].posts == [] and len(handlers[0].posts) == 1
            # with a folder of the step, the servers left out load it
            await pool.load_weights("/w/step_1", 2, "f" * 32, MEMORY, served=[a.url])
            assert handlers[0].posts[-1] == ("/admin/weights/receive", {"step": 2})
            assert handlers[2].posts[-1] == ("/admin/load_weights", {"path": "/w/step_1", "step": 2, "checksum": None})
        finally:
            await pool.close()

    with stand_in(handlers[0]) as u0, stand_in(handlers[1]) as u1, stand_in(handlers[2]) as u2:
        asyncio.run(go([u0, u1, u2]))


def test_rollouts_whose_images_cannot_train_get_an_error_naming_environment_task_turn_and_image(tmp_path):
    """The image checks before a rollout can train: a picture the processor would resize, image
    tokens that do not match the picture's size, images for a text model. Good rollouts and
    already-failed ones are left as they are. (A 64 x 64 picture with patches of 16 merged
    2 x 2 makes 4 image tokens.)"""
    import json

    from primerl_orchestrator.images import check_images
    from primerl_protocol.images import Image, model_images
    from primerl_protocol.rollouts import Rollout, Turn

    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen3_5", "vision_config": {}, "image_token_id": 9})
    )
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({"patch_size": 16, "merge_size": 2, "size": {"shortest_edge": 1024, "longest_edge": 1 << 20}})
    )
    vision = model_images(str(tmp_path))
    assert vision.image_token_id == 9 and vision.spec.factor == 32

    def rollout(sample_id, prompt, images, error=None):
        return Rollout(
            sample_id=sample_id,
            group_id=0,
            reward=1.0,
            error=error,
            turns=[
                Turn(prompt_ids=[1, 2], completion_ids=[3], completion_logprobs=[-0.1]),
                Turn(
                    prompt_ids=prompt,
                    completion_ids=[3],
                    completion_logprobs=[-0.1],
                    images=[Image(height=h, width=w, rgb=bytes(h * w * 3)) for h, w in images],
                ),
            ],
        )

    good = rollout(0, [1, 9, 9, 9, 9, 2], [(64, 64)])
    resized = rollout(1, [1, 9, 9, 9, 9, 2], [(60, 64)])
    too_few = rollout(2, [1, 9, 9, 2], [(64, 64)])
    failed = rollout(3, [1, 9, 2], [(64, 64)], error="TimeoutError: slow")
    assert check_images([good, resized, too_few, failed], vision, "shapes", "'t7'") == 2
    assert good.error is None and good.reward == 1.0 and failed.error == "TimeoutError: slow"
    assert resized.error.startswith("ImageError: environment 'shapes', task 't7', turn 1: image 1: an image of 60 x 64")
    assert "would be resized to 64 x 64" in resized.error and resized.reward == 0.0
    assert "image 1 (64 x 64 pixels) makes 4 image tokens but its run has 2" in too_few.error
    sampled = rollout(5, [1, 9, 9, 9, 9, 2], [(64, 64)])
    sampled.turns[0].completion_ids = [3, 9]  # an untrained model may sample the placeholder
    sampled.turns[0].completion_logprobs = [-0.1, -0.2]
    assert check_images([sampled], vision, "shapes", "'t7'") == 1
    assert sampled.error.endswith("turn 0: the model sampled the image token (id 9), which stands for no picture")

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert model_images(str(tmp_path)) is None
    text = rollout(4, [1, 9, 9, 9, 9, 2], [(64, 64)])
    assert check_images([text], None, "shapes", "'t7'") == 1
    assert "the prompt holds 1 images but the model has no vision tower" in text.error


def test_a_task_whose_prompt_holds_a_picture_that_cannot_train_is_refused_before_any_request(tmp_path):
    """The task's own pictures are checked first: one that does not decode, one the processor
    would resize, any for a text model -> the group's rollouts carry an ImageError naming the
    environment and the task (and no tokens), tagged with the policy served now; a good picture
    passes."""
    import base64
    import io
    import json
    from types import SimpleNamespace

    from PIL import Image as PILImage
    from primerl_orchestrator.images import refuse_task_images, task_images_problem
    from primerl_protocol.images import model_images

    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen3_5", "vision_config": {}, "image_token_id": 9})
    )
    vision = model_images(str(tmp_path))  # Qwen3.5's processor defaults: factor 32, at least 65,536 pixels

    def task(url):
        parts = [{"type": "text", "text": "How many?"}, {"type": "image_url", "image_url": {"url": url}}]
        return SimpleNamespace(data=SimpleNamespace(prompt=[{"role": "user", "content": parts}]))

    def png(size):
        buf = io.BytesIO()
        PILImage.new("RGB", (size, size), (9, 9, 9)).save(buf, "PNG")
        return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

    assert task_images_problem(task(png(256)), vision) is None
    assert "image 1 of the prompt: an image of 250 x 250 pixels would be resized to 256 x 256" in task_images_problem(
        task(png(250)), vision
    )
    assert "image 1 of the prompt: not a readable image" in task_images_problem(
        task("data:image/png;base64," + base64.b64encode(b"GIF89a but not").decode()), vision
    )
    assert task_images_problem(task(png(256)), None) == "the prompt holds 1 images but the model has no vision tower"
    assert refuse_task_images(task(png(256)), vision, "shapes", "'k'", [8, 16], 3, 5) is None
    refused = refuse_task_images(task(png(250)), vision, "shapes", "'k'", [8, 16], 3, 5)
    assert [(r.sample_id, r.group_id, r.policy_step, r.turns) for r in refused] == [(8, 3, 5, []), (16, 3, 5, [])]
    assert all(
        r.error.startswith("ImageError: environment 'shapes', task 'k': image 1 of the prompt: an image of 250")
        for r in refused
    )
