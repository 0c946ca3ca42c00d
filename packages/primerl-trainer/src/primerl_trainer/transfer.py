"""The trainer's side of weights in memory (`trainer.weights.transport = "memory"`): the stream of
primerl_protocol.transfer, sent by rank 0 to the servers' workers, one group of tensors (a
decoder layer, the embeddings, the final norm and head) at a time.

Every rank takes part in each group's gather (FSDP shards and expert-parallel experts are
all-gathered one parameter at a time, in the same order on every rank), so the trainer holds
at most one layer's full tensors beyond its shards; rank 0 casts them to the published dtype on
the device, renames them to HF's names and layouts there (the family's checkpoint table, as a
published folder would hold them), packs them into one buffer there, copies it to host memory
in one piece and broadcasts it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator

import torch
from primerl_models.hf import FP8Layout, family_for, to_fp8
from primerl_protocol import transfer
from primerl_protocol.messages import PolicyReady
from primerl_protocol.serving import ADMIN_TOKEN_ENV, WEIGHTS_JOIN_ROUTE, bearer
from primerl_protocol.weights import MEMORY

from primerl_trainer.config import WeightsConfig
from primerl_trainer.distributed import Dist
from primerl_trainer.publish import FolderPublisher, gathered

log = logging.getLogger("primerl.trainer")

_INDEXED = re.compile(r"^(.*?\.)?(\d+)\.")


def layer_groups(names: list[str]) -> list[list[str]]:
    """Names grouped by their first index segment (`layers.3.` -> one group per layer); names
    without one before the first layer form a group (embeddings), those after it another (final
    norm, head). Every rank computes the same groups in the same order from the same names."""
    pre, post, layers = [], [], {}
    for name in names:
        m = _INDEXED.match(name)
        if m is None:
            (post if layers else pre).append(name)
        else:
            layers.setdefault((m[1] or "", int(m[2])), []).append(name)
    return [g for g in (pre, *layers.values(), post) if g]


class MemorySender:
    """Sends the model's weights to the workers of one or more transfer groups, each hosted by
    rank 0 (`open`); every rank calls `send`, whose gathers are collectives."""

    def __init__(
        self, model: torch.nn.Module, hf_config: dict, dtype: torch.dtype, d: Dist, fp8: FP8Layout | None = None
    ):
        if any(".lora_" in name for name, _ in model.named_parameters()):
            raise ValueError(
                'trainer.weights.transport = "memory" does not carry LoRA adapters yet: '
                'use transport = "folder" with trainer.lora'
            )
        self.hf_config, self.dtype, self.d = hf_config, dtype, d
        self.fp8 = fp8
        """A block-FP8 source's layout: those weights travel quantised (e4m3 and weight_scale_inv),
        as the servers' FP8 layers read them (hf.to_fp8, as the folders hold them)."""
        self.to_hf = family_for(hf_config).checkpoint.to_hf
        self.links: dict[str, transfer.Group] = {}
        """The transfer groups rank 0 sends to, by name (a server's URL)."""
        self.last_timing: dict[str, float] = {}
        self.hosts: list = []
        """Rank 0, background sends: each layer group's host buffer, kept from update to update."""
        self._sending: threading.Thread | None = None
        self._outcome: tuple | None = None

    def open(self, name: str, port: int, secret: str, world_size: int, timeout_s: float, store=None) -> None:
        """Rank 0: host a group named `name` (`store`: its rendezvous, from transfer.host_store)
        and wait, at most `timeout_s`, until its `world_size - 1` workers joined it."""
        self.links[name] = transfer.open_group("127.0.0.1", port, secret, 0, world_size, timeout_s, store=store)

    def groups(self, model: torch.nn.Module) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Each group's tensors, HF-named, on rank 0's device (empty lists elsewhere)."""
        state = model.state_dict()
        buffers = {name for name, _ in model.named_buffers()}  # keep their dtype (fp32 router biases)
        for names in layer_groups(list(state)):
            ours = dict(gathered(state, names, buffers, self.dtype, self.d))
            if not self.d.is_main:
                yield []
                continue
            # renamed (and experts split), quantised if FP8, on the device; packed there too (transfer.pack)
            hf = self.to_hf(ours)
            yield list((to_fp8(hf, self.fp8) if self.fp8 else hf).items())

    def send(self, model: torch.nn.Module, step: int, background: bool = False) -> tuple[str | None, dict[str, str]]:
        """Send the weights after `step` to every open group (every rank calls it; the groups'
        members must be receiving); rank 0 returns what `wait` says. By default the update is
        sent as it is packed, layer by layer. `background`: rank 0 packs the whole update into
        host buffers it keeps (`hosts`, reused by the next update), sends it from a thread
        while the caller trains on, and returns (None, {}) at once: `wait` says how it went,
        and must be asked before the next send."""
        t0 = time.monotonic()
        with torch.no_grad():
            if not self.d.is_main:
                for _ in self.groups(model):
                    pass
                return None, {}
            if self._sending is not None or self._outcome is not None:
                raise RuntimeError("MemorySender.send: the last update's outcome was not taken (wait() first)")
            names, groups = list(self.links), list(self.links.values())
            if not background:
                self._outcome = (names, *transfer.send_update(groups, step, self.groups(model)))
                self.last_timing = {"send": time.monotonic() - t0}
                return self.wait()
            update = list(transfer.pack_update(step, self.groups(model), hosts=self.hosts))
            packed_s = time.monotonic() - t0

            def body():
                t1 = time.monotonic()
                try:
                    self._outcome = (names, *transfer.send_packed(groups, step, update))
                except BaseException as err:  # a bug, not a server's failure: said by wait()
                    self._outcome = (names, None, {i: f"{type(err).__name__}: {err}" for i in range(len(names))})
                self.last_timing = {"pack": packed_s, "send": time.monotonic() - t1}

            self._sending = threading.Thread(target=body, name="primerl-weights-send", daemon=True)
            self._sending.start()
            return None, {}

    def wait(self) -> tuple[str | None, dict[str, str]]:
        """Rank 0: wait for the update in flight, if any; the last update's checksum and, by
        name, the groups that failed it and why (they are closed: they need `open` again)."""
        if self._sending is not None:
            self._sending.join()
            self._sending = None
        if self._outcome is None:
            return None, {}
        (names, checksum, failed), self._outcome = self._outcome, None
        failed_names = {names[i]: why for i, why in failed.items()}
        for name in failed_names:
            self.links.pop(name, None)
        return checksum, failed_names


class MemoryPublisher:
    """trainer.weights.transport = "memory": after each step rank 0 streams the weights to every
    server in trainer.weights.servers (each its own transfer group, joined through its admin
    route with the run's secret the first time, and again after a failure or a restart), while
    each server receives them through its receive route; a folder is still published every
    `folder_every` steps and at the last step. A server that cannot be joined or does not receive
    a step whole is named in the log and left out of PolicyReady.served (the orchestrator then
    stops sending it rollouts until it serves the policy again); the run goes on.

    Why a group per server rather than one for all: gloo and NCCL groups cannot change members,
    so a server that restarts or joins later would need every server's group rebuilt; one group
    each keeps a failure, a timeout or a late join to that server alone. The cost: rank 0 sends
    the bytes once per server."""

    format = MEMORY

    def __init__(
        self,
        folders: FolderPublisher,
        model: torch.nn.Module,
        hf_config: dict,
        cfg: WeightsConfig,
        dtype: torch.dtype,
        d: Dist,
        max_steps: int | None,  # None: the run has no last step (its folder is not due at an end)
    ):
        if not cfg.servers:
            raise ValueError(
                'trainer.weights.transport = "memory" needs the servers\' URLs in trainer.weights.servers '
                "(primerl rl fills them in)"
            )
        self.folders, self.model, self.cfg, self.d, self.max_steps = folders, model, cfg, d, max_steps
        self.sender = MemorySender(model, hf_config, dtype, d, fp8=folders.fp8)
        self.token = cfg.admin_token or os.environ.get(ADMIN_TOKEN_ENV)
        self.secret = secrets.token_hex(16)
        self.servers = [url.rstrip("/") for url in cfg.servers]
        self.host = cfg.host or _address_towards(urllib.parse.urlsplit(self.servers[0]).hostname or "127.0.0.1")
        self.last: PolicyReady | None = None
        self.last_timing: dict[str, float] = {}
        self.announce: Callable[[PolicyReady], None] | None = None
        """Rank 0: how PolicyReady reaches the orchestrator (rl.py sets it: its policy socket)."""
        self.down: set[str] = set()
        """Servers found not up at the last join (named once)."""
        self.sending = -1
        """The step of the update last sent (or in flight)."""
        self.failed = 0
        """Server updates that did not arrive whole, so far."""
        self.strangers = 0
        """Rendezvous keys (ranks taken or tried) of processes without the run's secret, so far."""

    @property
    def published(self) -> bool:
        return self.last is not None or self.folders.published

    @property
    def keep_every(self) -> int:
        return self.folders.keep_every

    @keep_every.setter
    def keep_every(self, value: int) -> None:
        self.folders.keep_every = value

    def folder_due(self, step: int) -> bool:
        every = self.cfg.folder_every
        return step + 1 == self.max_steps or bool(every) and (step + 1) % every == 0

    def publish(self, model: torch.nn.Module, step: int) -> None:
        """Every rank: publish the folder if one is due, then send the weights after `step`
        (policy step + 1, as the orchestrator numbers policies). Rank 0 first joins the servers
        in no group yet and announces PolicyReady(format "memory", served = the servers it is
        about to send to) through `announce`: the orchestrator then has each of them receive,
        when it is ready to (an eval in progress first finishes on the old policy). Returns
        None: the announcement is made here, before the stream, not by the caller."""
        folder = self.folders.publish(model, step) if self.folder_due(step) else None
        t0 = time.monotonic()
        if self.d.is_main:
            if self.announce is None:
                raise RuntimeError("MemoryPublisher.announce is not set: nobody would tell the orchestrator")
            self._settle()  # the last step's update, if still in flight (overlap), goes out whole first
            self._join_missing()
            self.last = PolicyReady(
                step=step,
                location=folder.location if folder else "",
                checksum=folder.checksum if folder else "",
                format=MEMORY,
                served=list(self.sender.links),
            )
            self.announce(self.last)
        self.sender.send(model, step + 1, background=self.cfg.overlap)  # every rank: the gathers
        self.sending = step
        if self.d.is_main and not self.cfg.overlap:
            self._settle()
        self.last_timing = {"memory": time.monotonic() - t0, **(self.folders.last_timing if folder else {})}
        return None

    def _settle(self) -> None:
        """Rank 0: wait for the update in flight; name the servers that did not get it whole."""
        _, failed = self.sender.wait()
        self.failed += len(failed)
        for url, why in failed.items():
            log.warning(
                "inference server %s did not receive the weights of step %d in memory: %s (it is joined "
                "again at the next step)",
                url,
                self.sending,
                why,
            )

    def close(self) -> None:
        """Rank 0: the last update goes out whole (or fails, each server within the timeout)."""
        if self.d.is_main:
            self._settle()

    @property
    def counts(self) -> dict[str, float]:
        """Rank 0's running counts for the step's metrics: server updates that failed, rendezvous
        keys of processes without the run's secret, seconds the last update took to send."""
        return {
            "weights/failed": self.failed,
            "weights/strangers": self.strangers,
            **{f"time/weights_{k}": v for k, v in self.sender.last_timing.items()},
        }

    def announce_again(self, step: int) -> None:
        """A step that changed nothing: the weights are sent again under the new step (the
        servers' policy must be the step the orchestrator is told)."""
        return self.publish(self.model, step)

    def _join_missing(self) -> None:
        """Join every server that is in no group yet (rank 0); those that cannot are named."""
        for url in self.servers:
            if url in self.sender.links:
                continue
            try:  # a server that is down (killed, restarting) is not waited for: asked again next step
                urllib.request.urlopen(url + "/health", timeout=5).close()
            except OSError as err:
                if url not in self.down:  # said once, until it is up again
                    log.warning("inference server %s is not up (%s): no weights in memory for it until it is", url, err)
                self.down.add(url)
                continue
            self.down.discard(url)
            size = 1 + self.cfg.workers_per_server  # rank 0 and the server's workers
            store = transfer.host_store(0, size, self.cfg.timeout_s)
            body = {
                "host": self.host,
                "port": store.port,
                "secret": self.secret,
                "rank": 1,
                "world_size": size,
                "timeout_s": self.cfg.timeout_s,
            }
            # The group's rendezvous in a thread: a server that refuses the join (or is gone) must
            # not keep rank 0 waiting for it until the group's timeout; that thread then ends by
            # itself at the timeout, its group never used.
            opened = _in_thread(
                lambda: self.sender.open(url, store.port, self.secret, size, self.cfg.timeout_s, store=store)
            )
            try:
                self._post(url, WEIGHTS_JOIN_ROUTE, body)  # answers once the server's workers are in
                failure = None
            except RuntimeError as err:
                failure = err
            try:  # the group's outcome; at once if the post failed (a stranger's rank shows there)
                opened(None if failure is None else 1.0)
            except RuntimeError as err:
                failure = err
            if failure is not None:
                self.sender.links.pop(url, None)
                if isinstance(failure, transfer.Stranger):  # the group met, with a member not holding the secret
                    self.strangers += len(failure.ranks)
                log.warning(
                    "inference server %s could not join the trainer's weight transfer: %s",
                    url,
                    str(failure).splitlines()[0][:300],
                )
            if n := transfer.strangers(store, self.secret):
                self.strangers += n
                log.warning(
                    "%d process(es) without the run's secret tried to join the weight transfer group of %s "
                    "(%s:%d): refused",
                    n,
                    url,
                    self.host,
                    store.port,
                )

    def _post(self, url: str, route: str, body: dict) -> dict:
        """POST an admin route of `url`; RuntimeError naming the route and what went wrong."""
        req = urllib.request.Request(
            url + route,
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json", **bearer(self.token or "")},
        )
        try:
            with urllib.request.urlopen(req, timeout=self.cfg.timeout_s + 60) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as err:
            raise RuntimeError(
                f"{route} answered HTTP {err.code}: {err.read()[:300].decode(errors='replace')}"
            ) from None
        except (OSError, ValueError) as err:
            raise RuntimeError(f"{route}: {type(err).__name__}: {err}") from None


def _address_towards(host: str) -> str:
    """This machine's address on the route to `host` (127.0.0.1 for a server on this machine):
    what a server there reaches rank 0 at, whatever node of a job rank 0 landed on. No packet
    is sent (a UDP socket's connect only picks the route); this machine's name if that fails."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    try:
        family = socket.getaddrinfo(host, None)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return probe.getsockname()[0]
    except OSError:
        return socket.getfqdn()


def _in_thread(fn):
    """Run fn in a thread; a callable that waits for it and returns its result (or raises its
    RuntimeError). A connection failure reaches the caller instead of hanging the sender: a
    sender whose receiver never came waits at most the group's timeout."""
    out: dict = {}

    def body():
        try:
            out["value"] = fn()
        except RuntimeError as err:
            out["error"] = err

    t = threading.Thread(target=body, daemon=True)
    t.start()

    def result(timeout: float | None = None):
        """Its result; None if it is still running after `timeout` seconds (it is left to end by
        itself, at the group's timeout)."""
        t.join(timeout)
        if "error" in out:
            raise out["error"]
        return out.get("value")

    return result
