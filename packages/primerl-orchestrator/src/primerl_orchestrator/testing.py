"""A test double of the trainer, for testing the orchestrator without torch (and it says so).

`TrainerDouble` connects to the orchestrator's sockets exactly as the trainer does, receives
each step's TrainBatch on every rank, records what it would train on (steps, sample ids,
policy steps, metrics), sleeps `step_time_s` (a deliberately slow trainer), then publishes
"new" weights: a copy of the unchanged model folder as `weights/step_N` with the real marker
and checksum, so inference servers load it through the real admin route (or, given an
`adapter` folder, a copy of that LoRA adapter, published as an adapter). It writes
checkpoints' `meta.json` as the trainer does (with the orchestrator's state), resumes from
them, and can stop abruptly after a given step (a crash). `garbage_server` is a broken
inference server; `run_builder` runs the orchestrator's batch builder over finished groups.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from primerl_protocol import BatchMessage, PolicyMessage, PolicyReady, Receiver, Sender, Shutdown, TrainBatch, rundir
from primerl_protocol.config import TransportConfig
from primerl_protocol.weights import ADAPTER, ADAPTER_CONFIG, FULL, write_marker


@dataclass
class TrainedStep:
    step: int
    sample_ids: list[int]
    policy_steps: list[int]
    metrics: dict
    received_at: float
    rows: list = field(default_factory=list)
    """The micro-batches every rank received (to check what the servers generated)."""


@dataclass
class TrainerDouble:
    transport: TransportConfig
    """The shared TransportConfig (endpoints, ranks, socket settings)."""
    run_dir: Path
    model: Path
    """A model folder, republished unchanged as every step's weights."""
    max_steps: int
    step_time_s: float = 0.0
    checkpoint_interval: int = 0
    crash_after: int | None = None
    """Stop without a word after training this step (before its checkpoint)."""
    publish: bool = True
    """Publish weights after each step (off: only after the last one, so the servers keep
    their weights during the run; for benchmarks)."""
    adapter: Path | None = None
    """A LoRA adapter folder (PEFT's layout) for `model`: republished as every step's adapter
    (format peft-lora) instead of the model."""
    steps: list[TrainedStep] = field(default_factory=list)
    published: list[int] = field(default_factory=list)
    stopped: str | None = None
    """The reason of the Shutdown the orchestrator sent, if it sent one."""
    error: BaseException | None = None

    def start(self) -> TrainerDouble:
        self._thread = threading.Thread(target=self._main, name="trainer-double", daemon=True)
        self._thread.start()
        return self

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"trainer double still running after {timeout_s}s (trained {len(self.steps)} steps)")
        if self.error is not None:
            raise self.error

    def _main(self) -> None:
        t = self.transport
        rx = [
            Receiver(t.batch_endpoint(r), BatchMessage, channel=f"batches/rank{r}", settings=t.sockets)
            for r in range(t.ranks)
        ]
        policy = Sender(t.policy_endpoint(), PolicyMessage, channel="policy", settings=t.sockets)
        try:
            found = rundir.latest_checkpoint(self.run_dir)
            step = 0 if found is None else found[1]["step"] + 1
            if step:
                policy.send(self._publish(step - 1))
            while step < self.max_steps:
                batches = [r.recv(timeout_s=300) for r in rx]
                if stop := next((b for b in batches if isinstance(b, Shutdown)), None):
                    self.stopped = stop.reason or "(no reason)"
                    return
                batches = [b for b in batches if isinstance(b, TrainBatch)]
                assert all(b.step == step for b in batches), [b.step for b in batches]
                ids, steps, rows = [], [], []
                for b in batches:
                    rows += b.micro_batches
                    for mb in b.micro_batches:
                        keep = mb.sample_ids >= 0
                        ids += mb.sample_ids[keep].tolist()
                        steps += mb.policy_steps[keep].tolist()
                self.steps.append(TrainedStep(step, ids, steps, dict(batches[0].metrics), time.time(), rows))
                time.sleep(self.step_time_s)
                if self.crash_after == step:
                    return
                if self.publish or step == self.max_steps - 1:
                    policy.send(self._publish(step))
                if self.checkpoint_interval and (step + 1) % self.checkpoint_interval == 0:
                    self._checkpoint(step, batches[0].state)
                step += 1
        except BaseException as err:  # reported by join()
            self.error = err
        finally:
            for r in rx:
                r.close(0)
            policy.close(0)

    def _publish(self, step: int) -> PolicyReady:
        root = rundir.RunDir(self.run_dir).weights
        final, tmp = rundir.step_folder(root, step), rundir.staging_folder(root, step)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(self.adapter or self.model, tmp)
        fmt = FULL if self.adapter is None else ADAPTER
        files = [p.name for p in tmp.glob("*.safetensors")] + ([ADAPTER_CONFIG] if self.adapter else [])
        digest = write_marker(tmp, step, files, time.time(), format=fmt)
        rundir.publish(tmp, final)
        self.published.append(step)
        return PolicyReady(step=step, location=str(final.resolve()), checksum=digest, format=fmt)

    def _checkpoint(self, step: int, orchestrator_state: dict) -> None:
        root = rundir.RunDir(self.run_dir).checkpoints
        final, tmp = rundir.step_folder(root, step), rundir.staging_folder(root, step)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        meta = {"step": step, "world_size": 1, "data": {"next_step": step + 1, "orchestrator": orchestrator_state}}
        rundir.write_meta(tmp, meta)
        rundir.publish(tmp, final)


def run_builder(orch, groups: list) -> list[TrainBatch]:
    """Run `orch`'s real batch builder (`Orchestrator._build`, until its max_steps) over
    `groups`, all finished, in that order, without inference servers or environments (the
    producer's part is done: the groups are there); rank 0's TrainBatch of every step, as a
    trainer receives it over a real ZeroMQ socket (inproc). The policy stays at `orch.version`."""
    import asyncio
    from types import SimpleNamespace

    from primerl_protocol import AsyncReceiver, AsyncSender

    from primerl_orchestrator.generate import Generator
    from primerl_orchestrator.servers import ServerPool

    steps = orch.cfg.max_steps - orch.step
    orch.out_dir.mkdir(parents=True, exist_ok=True)
    orch.mix = SimpleNamespace(state=lambda: {"current": [0.0], "positions": {}})  # only asked for its state
    endpoint = f"inproc://batches-{id(orch)}"

    async def go() -> list[TrainBatch]:
        orch.pool = ServerPool(["http://127.0.0.1:9"], "m", None)  # never started: the builder reads its counters
        orch.gen = Generator(orch.pool, "m", "m")
        orch.senders = [AsyncSender(endpoint, BatchMessage, channel="batches/rank0", bind=True)]
        trainer = AsyncReceiver(endpoint, BatchMessage, channel="batches/rank0")
        try:
            orch.done.extend(groups)
            builder = asyncio.create_task(orch._build())
            received = [await trainer.recv(timeout_s=10) for _ in range(steps)]
            await asyncio.wait_for(builder, 5)
            return received
        finally:
            trainer.close(0)
            orch.senders[0].close(0)
            await orch.pool.close()

    return asyncio.run(go())


class _GarbageHandler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"\x00\xffnot json at all"
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def garbage_server() -> Iterator[str]:
    """A real HTTP server on a free port that answers every request with 200 and bytes that
    mean nothing (a broken inference server); yields its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _GarbageHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
