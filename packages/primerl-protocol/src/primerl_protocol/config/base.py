"""The config base class and the values every process shares (defined once, handed down).

A package defines its own section as a `Config` subclass in its `config.py`; a command's root
config inherits `SharedConfig` and adds the sections it needs, so `cfg.seq_len` is the same
value for the trainer, the orchestrator and inference, written once in the TOML file.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

import msgspec

from primerl_protocol.auth import KEYS_ENV, CurveKeys, is_loopback
from primerl_protocol.transport import SocketSettings

Positive = Annotated[int, msgspec.Meta(gt=0)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
C = TypeVar("C", bound="Config")
DEFAULT_POLICY_PORT, DEFAULT_BATCH_PORT = 5600, 5601
"""The transport's ports when unset and no launcher chose them (a trainer and an orchestrator
started by hand, a Slurm job's)."""


class Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base of every config section: strict (unknown keys fail) and keyword-only."""

    def project(self, target: type[C]) -> C:
        """The `target` config made of this config's fields of the same names.

        How shared values are handed down: `rl_config.project(TrainerRunConfig)` gives the
        trainer the same model, seq_len, ... and its own section, nothing copied by hand.
        """
        names = [f.name for f in msgspec.structs.fields(target)]
        missing = [n for n in names if not hasattr(self, n)]
        if missing:
            raise TypeError(f"{type(self).__name__} has no {missing} for {target.__name__}")
        return target(**{n: getattr(self, n) for n in names})


class ModelConfig(Config):
    """Which model to train or serve."""

    name: str
    """A Hugging Face hub id or a local folder in Hugging Face layout (config.json, safetensors)."""
    tokenizer: str | None = None
    """Tokenizer hub id or folder, when it differs from `name`."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) to load."""


class TransportConfig(Config):
    """Where the orchestrator and the trainer talk (ZeroMQ), and how patiently."""

    host: str = "127.0.0.1"
    """Host the orchestrator binds its sockets on (the trainer connects to it). Any address but
    loopback needs the run's keys (sockets.curve), so that no one else on the network can talk
    to the run; `primerl rl` and `--slurm` make them."""
    batch_port: Port | None = None
    """Trainer rank r receives its batches on batch_port + r. Unset: `primerl rl` takes free
    ports at launch (written to run_dir/configs); a trainer and an orchestrator started alone
    use 5601. Set: `primerl rl` refuses a busy one before anything starts, naming this key."""
    policy_port: Port | None = None
    """The orchestrator receives PolicyReady from the trainer here. Unset: as batch_port (alone: 5600)."""
    trainer_ranks: Positive | None = None
    """Ranks of the trainer: the orchestrator packs each step for this many and sends rank r
    its share on batch_port + r. Unset: the launcher's count where it has one (a trainer
    under torchrun takes torchrun's; `--slurm` the trainer nodes' GPUs), else 1 (`ranks`).
    Set, it must agree: a trainer under torchrun refuses another value, naming both."""
    sockets: SocketSettings = SocketSettings(recv_timeout_s=1800.0)
    """High-water marks, linger, timeouts and kernel buffers of both sockets. A trainer that
    hears nothing (not even a heartbeat) for recv_timeout_s stops with a clear error. Also
    the run's CURVE keys (sockets.curve) that authenticate the trainer and the orchestrator."""

    def __post_init__(self) -> None:
        if not is_loopback(self.host) and self.sockets.resolved_curve() is None:
            raise ValueError(
                f"host {self.host!r} is not a loopback address, and no keys authenticate the sockets: anyone "
                f"who reaches it could stop the run or take its batches. Set transport.sockets.curve or "
                f"${KEYS_ENV} (`CurveKeys.generate().to_toml()` makes them), or run through `primerl rl` "
                "(it makes keys per run)"
            )

    @property
    def ranks(self) -> int:
        """The trainer's ranks as this process knows them: trainer_ranks, or 1 when unset."""
        return self.trainer_ranks or 1

    def with_run_keys(self) -> TransportConfig:
        """This config with CURVE keys: the configured ones, else fresh ones for this run."""
        if self.sockets.curve is not None:
            return self
        keys = CurveKeys.from_env() or CurveKeys.generate()
        return msgspec.structs.replace(self, sockets=msgspec.structs.replace(self.sockets, curve=keys))

    def batch_endpoint(self, rank: int) -> str:
        port = DEFAULT_BATCH_PORT if self.batch_port is None else self.batch_port
        return f"tcp://{self.host}:{port + rank}"

    def policy_endpoint(self) -> str:
        port = DEFAULT_POLICY_PORT if self.policy_port is None else self.policy_port
        return f"tcp://{self.host}:{port}"


class WandbConfig(Config):
    """Weights & Biases logging. Offline unless you are logged in or ask for online."""

    mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    """auto: online if a W&B API key is configured, else offline files in the run directory."""
    project: str = "primerl"
    """W&B project name."""
    name: str | None = None
    """Run name (default: the run directory's name)."""
    tags: list[str] = []
    """Tags added to the W&B run."""


class SharedConfig(Config):
    """Values every process of a run reads: defined once at the top of the config."""

    model: ModelConfig
    """The model: trained by the trainer, served by inference."""
    seq_len: Positive = 4096
    """Tokens in one packed training row; also the longest prompt + completion."""
    max_steps: Positive | None = None
    """Optimizer steps to train for (None: until stopped)."""
    run_dir: str = "runs/primerl"
    """Folder that holds everything the run writes; rerunning on it resumes."""
    seed: int = 0
    """Seed for every random choice (data order, sampling, init of tiny models)."""
    transport: TransportConfig = msgspec.field(default_factory=TransportConfig)
    """Orchestrator <-> trainer sockets."""
    wandb: WandbConfig = msgspec.field(default_factory=WandbConfig)
    """Weights & Biases logging (one run shared by trainer and orchestrator)."""
