"""The messages that cross process boundaries, one tagged union per socket.

Every message is a msgspec Struct tagged by its class name in the field ``type`` and carries
the protocol ``version``. Bulk arrays (token ids, logprobs, advantages, ...) are numpy arrays:
the codec (codec.py) sends each one as its own raw frame beside a small msgpack header, so
a 500k-token batch is never turned into Python lists.

Sockets and their unions:
  orchestrator -> trainer rank r   BatchMessage  = TrainBatch | Heartbeat | Shutdown
  trainer -> orchestrator          PolicyMessage = PolicyReady | Heartbeat | Shutdown

Shape legend: T = tokens in a packed row, S = sequences (samples) in that row.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import numpy as np

from primerl_protocol.rollouts import RolloutSample

PROTOCOL_VERSION = 6
"""Bumped on any change to a message's fields; peers of other versions are refused.
2: TrainBatch carries the orchestrator's metrics and resume state.
3: MicroBatch carries its samples' images (image_pixels, image_sizes).
4: TrainBatch carries readable samples of the step's rollouts (`samples`, for the W&B table).
5: PolicyReady carries the servers that received the weights in memory (`served`).
6: MicroBatch's samples may share a prompt (`prefix_lens`, `parents`)."""


class Message(msgspec.Struct, tag=True, tag_field="type", forbid_unknown_fields=True, kw_only=True):
    """Base of every message: tagged by class name, versioned, strict about unknown fields."""

    version: int = PROTOCOL_VERSION


# Per-token arrays of a MicroBatch and the dtype each must have.
TOKEN_ARRAYS: dict[str, np.dtype] = {
    "input_ids": np.dtype(np.int32),
    "loss_mask": np.dtype(np.bool_),
    "inference_logprobs": np.dtype(np.float32),
    "advantages": np.dtype(np.float32),
    "temperatures": np.dtype(np.float32),
}
# Per-sequence arrays of a MicroBatch and their dtypes.
SEQUENCE_ARRAYS: dict[str, np.dtype] = {
    "seq_lens": np.dtype(np.int32),
    "sample_ids": np.dtype(np.int64),
    "policy_steps": np.dtype(np.int32),
    "prefix_lens": np.dtype(np.int32),
    "parents": np.dtype(np.int32),
}


class MicroBatch(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One packed row: several samples laid end to end, attention never crossing a boundary.

    Samples may share a prompt (the orchestrator's `share_prompts`): sample s with
    prefix_lens[s] = P > 0 starts with the same P tokens as sample parents[s] (an earlier
    sample of the row, whose own prefix is 0), and only its tokens after them are in the row.
    Its tokens attend to those P tokens of its parent and to its own, and sit at positions
    P, P + 1, ... (the positions they have in the whole sample)."""

    input_ids: np.ndarray
    """int32 [T]: prompt and completion tokens of every sample in the row, concatenated."""
    loss_mask: np.ndarray
    """bool [T]: True where the token was sampled by the policy and is trained on."""
    inference_logprobs: np.ndarray
    """float32 [T]: logprob of each token under the inference policy (0 where masked)."""
    advantages: np.ndarray
    """float32 [T]: advantage of each token."""
    temperatures: np.ndarray
    """float32 [T]: the sampling temperature each token was generated at."""
    seq_lens: np.ndarray
    """int32 [S]: length of each sample in the row; they sum to T. Positions restart at each."""
    sample_ids: np.ndarray
    """int64 [S]: the orchestrator's id of each sample (for resume and bookkeeping)."""
    policy_steps: np.ndarray
    """int32 [S]: the policy step that generated each sample (off-policy bookkeeping)."""
    prefix_lens: np.ndarray = msgspec.field(default_factory=lambda: np.zeros(0, np.int32))
    """int32 [S]: how many first tokens of each sample are not in its segment of the row because
    they are its parent's first tokens (its shared prompt); 0: the whole sample is there. Empty
    (the default): 0 for every sample."""
    parents: np.ndarray = msgspec.field(default_factory=lambda: np.zeros(0, np.int32))
    """int32 [S]: the sample of the row whose first prefix_lens[s] tokens sample s shares (an
    earlier one, itself without a prefix), -1 where prefix_lens is 0. Empty (the default): -1
    for every sample."""
    image_sizes: np.ndarray = msgspec.field(default_factory=lambda: np.zeros((0, 2), np.int32))
    """int32 [I, 2]: height and width of each image of the row, in the order of their runs of
    image tokens in `input_ids` (vision-language models; I = 0 otherwise)."""
    image_pixels: np.ndarray = msgspec.field(default_factory=lambda: np.zeros(0, np.uint8))
    """uint8 [sum of h * w * 3]: the images' RGB pixels, row-major, one after another."""

    def __post_init__(self) -> None:
        num_seqs = len(self.seq_lens) if isinstance(self.seq_lens, np.ndarray) else 0
        if isinstance(self.prefix_lens, np.ndarray) and not len(self.prefix_lens) and num_seqs:
            self.prefix_lens = np.zeros(num_seqs, np.int32)
        if isinstance(self.parents, np.ndarray) and not len(self.parents) and num_seqs:
            self.parents = np.full(num_seqs, -1, np.int32)
        for name, dtype in (TOKEN_ARRAYS | SEQUENCE_ARRAYS).items():
            arr = getattr(self, name)
            if not isinstance(arr, np.ndarray):
                raise TypeError(f"`{name}` must be a numpy array, got {type(arr).__name__}")
            if arr.ndim != 1:
                raise ValueError(f"`{name}` must be 1-D, got shape {arr.shape}")
            if arr.dtype != dtype:
                raise ValueError(f"`{name}` must have dtype {dtype}, got {arr.dtype}")
        num_tokens = len(self.input_ids)
        for name in TOKEN_ARRAYS:
            if len(getattr(self, name)) != num_tokens:
                raise ValueError(f"`{name}` has {len(getattr(self, name))} tokens but `input_ids` has {num_tokens}")
        num_seqs = len(self.seq_lens)
        for name in SEQUENCE_ARRAYS:
            if len(getattr(self, name)) != num_seqs:
                raise ValueError(f"`{name}` has {len(getattr(self, name))} entries but `seq_lens` has {num_seqs}")
        if num_seqs and int(self.seq_lens.min()) <= 0:
            raise ValueError("`seq_lens` must all be positive")
        total = int(self.seq_lens.sum(dtype=np.int64))
        if total != num_tokens:
            raise ValueError(f"`seq_lens` sum to {total} but the row has {num_tokens} tokens")
        if (problem := self._sharing_problem()) is not None:
            raise ValueError(problem)
        sizes, pixels = self.image_sizes, self.image_pixels
        if not isinstance(sizes, np.ndarray) or sizes.dtype != np.int32 or sizes.ndim != 2 or sizes.shape[1] != 2:
            raise ValueError(f"`image_sizes` must be an int32 array [images, 2], got {_describe(sizes)}")
        if not isinstance(pixels, np.ndarray) or pixels.dtype != np.uint8 or pixels.ndim != 1:
            raise ValueError(f"`image_pixels` must be a 1-D uint8 array, got {_describe(pixels)}")
        if len(sizes) and int(sizes.min()) <= 0:
            raise ValueError("`image_sizes` must all be positive")
        need = int((sizes.astype(np.int64).prod(axis=1) * 3).sum())
        if need != len(pixels):
            raise ValueError(f"`image_sizes` need {need} bytes of pixels but `image_pixels` has {len(pixels)}")

    def _sharing_problem(self) -> str | None:
        """Why `prefix_lens` and `parents` do not describe samples sharing earlier samples'
        prompts, or None."""
        prefix, parents = self.prefix_lens, self.parents
        if len(prefix) and int(prefix.min()) < 0:
            return "`prefix_lens` must all be >= 0"
        for s in np.flatnonzero((prefix != 0) | (parents != -1)).tolist():
            p = int(parents[s])
            if prefix[s] == 0 or not 0 <= p < s:
                return (
                    f"sample {s}: `parents` {p} with `prefix_lens` {int(prefix[s])}: a shared prompt needs "
                    "both, and its parent must be an earlier sample of the row"
                )
            if prefix[p] != 0:
                return f"sample {s}: its parent {p} shares a prompt itself (`prefix_lens` {int(prefix[p])})"
            if prefix[s] > self.seq_lens[p]:
                n, parent = int(prefix[s]), int(self.seq_lens[p])
                return f"sample {s}: `prefix_lens` {n} is longer than its parent {p} ({parent})"
        return None

    @property
    def shares_prompts(self) -> bool:
        """Some sample of the row shares another's prompt (prefix_lens > 0)."""
        return bool(len(self.prefix_lens) and self.prefix_lens.any())

    def images(self) -> list[np.ndarray]:
        """Each image of the row as a read-only uint8 [height, width, 3] view, in order."""
        out, at = [], 0
        for h, w in self.image_sizes.tolist():
            out.append(self.image_pixels[at : at + h * w * 3].reshape(h, w, 3))
            at += h * w * 3
        return out

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def position_ids(self) -> np.ndarray:
        """int32 [T]: position of each token within its own sample (restarting at 0, or at
        prefix_lens for a sample that shares its parent's first tokens)."""
        starts = np.repeat(np.cumsum(self.seq_lens) - self.seq_lens - self.prefix_lens, self.seq_lens)
        return (np.arange(self.num_tokens, dtype=np.int64) - starts).astype(np.int32)

    def predecessors(self) -> np.ndarray:
        """int64 [T]: the row index of the token each token follows in its sample (t - 1; for the
        first token of a sample that shares a prompt, the prompt's last token in its parent; 0
        for the row's first token). Token t's logprob is predicted from there."""
        prev = np.arange(-1, self.num_tokens - 1, dtype=np.int64)
        prev[0] = 0
        starts = self.cu_seqlens()[:-1].astype(np.int64)
        shared = np.flatnonzero(self.prefix_lens)
        prev[starts[shared]] = starts[self.parents[shared]] + self.prefix_lens[shared] - 1
        return prev

    def cu_seqlens(self) -> np.ndarray:
        """int32 [S + 1]: cumulative sequence boundaries, as varlen attention kernels take them."""
        return np.concatenate([[0], np.cumsum(self.seq_lens)]).astype(np.int32)


def _describe(arr) -> str:
    return f"{arr.dtype} {list(arr.shape)}" if isinstance(arr, np.ndarray) else type(arr).__name__


class TrainBatch(Message):
    """The micro-batches one trainer rank trains on for one optimizer step."""

    step: int
    """The trainer step this batch is for (0-based)."""
    rank: int
    """The data-parallel rank that trains on it."""
    num_ranks: int
    """The data-parallel world size the batch was packed for; every rank gets as many micro-batches."""
    micro_batches: list[MicroBatch]
    """This rank's packed rows, in order."""
    num_loss_tokens: int
    """Loss-masked tokens across all ranks' batches of this step (for token-normalised losses)."""
    num_sequences: int = 0
    """Samples across all ranks' batches of this step, padding excluded (for per-sequence
    and constant normalisation)."""
    created_at: float = msgspec.field(default_factory=time.time)
    """Wall-clock time (s since epoch) the orchestrator built the batch."""
    metrics: dict[str, float] = {}
    """The orchestrator's metrics of this step (rewards, drops, off-policy level, rates), for
    the trainer to log on the same step axis (rank 0's batch carries them)."""
    state: dict[str, Any] = {}
    """What the orchestrator needs to resume after this step (data positions, unfinished
    groups); the trainer stores it in the checkpoint of this step (rank 0's batch carries it)."""
    samples: list[RolloutSample] = []
    """Some of the step's rollouts as text, every `orchestrator.samples.interval` steps, for
    the trainer's W&B samples table (rank 0's batch carries them)."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.num_ranks:
            raise ValueError(f"`rank` {self.rank} is outside [0, {self.num_ranks})")
        if self.step < 0:
            raise ValueError(f"`step` must be >= 0, got {self.step}")


class PolicyReady(Message):
    """The trainer published the weights of `step`; inference should load them."""

    step: int
    """Trainer step whose weights these are."""
    location: str
    """Where the weights are: a folder path (HF layout), or a transport URI such as nccl://group."""
    checksum: str
    """Hex digest over the published files, checked by the loader before it swaps weights."""
    format: str = "hf-safetensors"
    """Layout of the weights at `location` (primerl_protocol.weights): "hf-safetensors", a whole
    model the servers load in place of theirs; "peft-lora", a LoRA adapter they load beside the
    base weights, and generation requests then name it as their model; "memory", whole weights
    the trainer sent to the servers in `served` (then `location`, if not empty, is a folder of
    the same step that the others can load, and `checksum` that folder's)."""
    served: list[str] = []
    """With format "memory": the URLs of the servers that received and serve these weights."""
    created_at: float = msgspec.field(default_factory=time.time)


class Heartbeat(Message):
    """I am alive. Sent when a sender has nothing else to say for a while."""

    sender: str
    """Which process sends it (e.g. "orchestrator", "trainer/0")."""
    seq: int = 0
    """Increasing per sender; a gap means heartbeats were lost."""
    sent_at: float = msgspec.field(default_factory=time.time)


class Shutdown(Message):
    """The sender is stopping (normally or not); the receiver should stop waiting for it."""

    sender: str
    reason: str = ""


BatchMessage = TrainBatch | Heartbeat | Shutdown
"""Orchestrator -> trainer rank."""
PolicyMessage = PolicyReady | Heartbeat | Shutdown
"""Trainer -> orchestrator."""
