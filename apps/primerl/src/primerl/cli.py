"""The commands: `primerl rl|sft|eval`, `primerl-orch`, `primerl-trainer`, `primerl-inference`.

Each command reads its config the same way (see primerl_protocol.config.load):

    primerl rl @ base.toml @ override.toml trainer.optimizer.lr=1e-5 --dry-run

and then hands it to its engine. Commands stay thin: config in, engine call, clear exit code.
Exit codes (docs/running.md):
  0    done
  1    it started and failed (a process, a server, an eval where every rollout errored): it says why
  2    the user's input is wrong, found before anything started: a config error (unknown key,
       wrong type, values that contradict each other), a bad argument (click's usage errors are
       2 too), or what a pre-start check refused (the model, an environment id, a run with
       nothing to evaluate, an adapter for another base model)
  130  stopped with Ctrl-C, 143 with SIGTERM (129 SIGHUP): `primerl rl` and `primerl-inference`
       stop every process they started first
"""

from __future__ import annotations

import contextlib
import signal
import sys
import typing

import click
import msgspec
from primerl_protocol.config import ConfigError, load_config, sections, to_toml

from primerl.configs import (
    EvalConfig,
    InferenceRunConfig,
    OrchRunConfig,
    RLConfig,
    SFTConfig,
    TrainerRunConfig,
)

EXIT_FAILED = 1
EXIT_CONFIG = 2
"""The user's input is wrong (config, arguments, a pre-start check): the code click gives usage errors."""

USAGE = """
Config: TOML files after `@`, composed left to right, then dotted overrides
(`key=value`, `--key=value` or `--key value`). --dry-run prints the resolved
config as TOML and exits.
"""


def _epilog(root: type) -> str:
    """The root's sections and top-level keys; those it shares with other roots but never reads
    (`UNUSED`, e.g. EvalRunConfig's) listed apart, as accepted and ignored."""
    unused = getattr(root, "UNUSED", ())
    # "\b" stops click from re-wrapping the block below it.
    lines = ["\b", "Config sections and top-level keys:"]
    lines += [f"  {name:<14} {doc}" for name, doc in sections(root) if name not in unused]
    if unused:
        lines += [
            "",
            "\b",
            "Accepted (a run's config may hold them) but unused by this command:",
            f"  {', '.join(unused)}",
        ]
    return "\n".join(lines)


def config_command(
    name: str,
    root: type,
    summary: str,
    engine: typing.Callable[[typing.Any], None],
    prog: str = "",
    slurm: typing.Callable[[typing.Any], typing.Any] | None = None,
):
    """A click command that loads `root` from its arguments and runs `engine(config)`.
    With `slurm` (config -> the job script it writes), it also takes --slurm/--submit."""
    prog = prog or name

    def command(dry_run: bool, args: tuple[str, ...], slurm_job: bool = False, submit: bool = False) -> None:
        try:
            config = load_config(root, args)
        except ConfigError as err:
            click.echo(f"{prog}: config error: {err}", err=True)
            sys.exit(EXIT_CONFIG)
        if dry_run:
            click.echo(to_toml(config), nl=False)
            return
        if slurm_job or submit:
            _slurm_job(prog, slurm, config, submit)
            return
        engine(config)

    command = click.argument("args", nargs=-1, type=click.UNPROCESSED)(command)
    if slurm:
        command = click.option("--submit", is_flag=True, help="With --slurm: also submit the job (sbatch).")(command)
        command = click.option(
            "--slurm",
            "slurm_job",
            is_flag=True,
            help="Write the Slurm job of this config to RUN_DIR/slurm instead of running here.",
        )(command)
    command = click.option("--dry-run", is_flag=True, help="Print the resolved config as TOML and exit.")(command)
    return click.command(
        name=name,
        help=f"{summary}\n{USAGE}",
        epilog=_epilog(root),
        context_settings={
            "ignore_unknown_options": True,
            "allow_extra_args": True,
            "help_option_names": ["-h", "--help"],
        },
    )(command)


def _slurm_job(prog: str, render, config, submit: bool) -> None:
    """Write the job (what does not fit the cluster, or a pre-start check, exits 2), submit it
    if asked (sbatch failing exits 1)."""
    from primerl.errors import CheckError
    from primerl.slurm import SlurmError
    from primerl.slurm import submit as sbatch

    try:
        script = render(config)
    except (SlurmError, CheckError) as err:
        click.echo(f"{prog}: {err}", err=True)
        sys.exit(EXIT_CONFIG)
    click.echo(f"wrote {script}")
    if not submit:
        click.echo(f"submit it with: sbatch {script}")
        return
    try:
        click.echo(f"submitted job {sbatch(script)}; its output: {config.slurm.log_dir or script.parent}/job-<id>.out")
    except SlurmError as err:
        click.echo(f"{prog}: {err}", err=True)
        sys.exit(EXIT_FAILED)


def _render_rl(config):
    """The RL job, after the checks `primerl rl` makes before anything starts (CheckError)."""
    from primerl.launch import check
    from primerl.plan import check_fits
    from primerl.slurm import render_rl

    config = check(config)
    check_fits(config, slurm=True)
    return render_rl(config)


def _render(name: str):
    def render(config):
        from primerl import slurm

        return getattr(slurm, f"render_{name}")(config)

    return render


def _run_trainer(config: TrainerRunConfig) -> None:
    from primerl_trainer.engine import SetupError
    from primerl_trainer.rl import TrainerError, train

    try:
        train(config)
    except (SetupError, TrainerError) as err:  # already logged by the trainer when it ran
        click.echo(f"primerl-trainer: {err}", err=True)
        sys.exit(EXIT_FAILED)


def _run_sft(config: SFTConfig) -> None:
    from primerl_trainer.engine import SetupError
    from primerl_trainer.sft import train
    from primerl_trainer.sft_data import DataError

    try:
        train(config)
    except (SetupError, DataError) as err:
        click.echo(f"primerl sft: {err}", err=True)
        sys.exit(EXIT_FAILED)


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP (a scheduler ending or preempting the job, `kill`, a closed terminal),
    raised as Ctrl-C's KeyboardInterrupt is, so that the command stops every process it started
    (in their own process groups, a signal to this one does not reach them)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stop_on_signals():
    def handler(signum, frame):
        for s in (signal.SIGTERM, signal.SIGHUP):  # the clean-up that follows is not cut short by a second one
            signal.signal(s, signal.SIG_IGN)
        raise Stopped(signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _stopped(prog: str, err: KeyboardInterrupt, what: str) -> None:
    """Exit after a stop: 128 + the signal's number, as a shell reports a process it killed."""
    how = err.args[0] if isinstance(err, Stopped) else "Ctrl-C"
    click.echo(f"{prog}: stopped ({how}){what}", err=True)
    sys.exit(128 + (err.signum if isinstance(err, Stopped) else signal.SIGINT))


def _check_here(prog: str, config, ports: bool | None = True, envs: tuple[str, list] | None = None):
    """The launchers' checks of this machine before anything starts (primerl.preflight): the run
    directory, the servers' ports (True: unset ones chosen free; False: unset means the default,
    8000; None: not checked), the environments `envs` names. A refusal exits 2, naming the key.
    Returns `config` with its ports."""
    from primerl.errors import CheckError
    from primerl.preflight import check_block, check_environments, check_run_dir, with_ports

    try:
        check_run_dir(config.run_dir)
        if ports:
            config = with_ports(config, transport=False)
        elif ports is False:
            inf = config.inference
            check_block(
                "inference.port",
                inf.base_port,
                inf.host,
                inf.num_replicas,
                "replica",
                hint="set inference.port to a free one",
            )
        if envs is not None:
            check_environments(*envs)
    except CheckError as err:
        click.echo(f"{prog}: {err}", err=True)
        sys.exit(EXIT_CONFIG)
    return config


def _run_inference(config: InferenceRunConfig) -> None:
    import time

    from primerl_inference.launcher import LaunchError, launch

    _check_here("primerl-inference", config, ports=False)
    try:
        servers = launch(config.inference, config.model.name, config.seq_len, config.run_dir)
    except LaunchError as err:
        click.echo(f"primerl-inference: {err}", err=True)
        sys.exit(EXIT_FAILED)
    for url in servers.urls:
        click.echo(f"serving {config.model.name} at {url}")
    try:
        with stop_on_signals():
            while True:
                servers.check_alive()
                time.sleep(1.0)
    except KeyboardInterrupt as err:
        click.echo("stopping the inference servers")
        _stopped("primerl-inference", err, "")  # SystemExit: the servers stop below
    except LaunchError as err:
        click.echo(f"primerl-inference: {err}", err=True)
        sys.exit(EXIT_FAILED)
    finally:
        servers.stop()


def _run_rl(config: RLConfig) -> None:
    from primerl.errors import CheckError, RunError
    from primerl.launch import run_rl

    try:
        with stop_on_signals():
            run_rl(config)
    except RunError as err:  # CheckError: refused before anything started
        click.echo(f"primerl rl: {err}", err=True)
        sys.exit(EXIT_CONFIG if isinstance(err, CheckError) else EXIT_FAILED)
    except KeyboardInterrupt as err:
        _stopped("primerl rl", err, "; rerun the same command to resume")


def _run_orchestrator(config: OrchRunConfig) -> None:
    from primerl_envs import compat
    from primerl_envs.environment import EnvLoadError
    from primerl_orchestrator.loop import OrchestratorError, run
    from primerl_orchestrator.servers import NoServerError
    from primerl_sandbox import claim_run

    compat.install()  # the process runs environments: primerl's patches of their packages, once
    killed = claim_run()  # its environments' sandboxes are this run's; a dead run's are killed
    if killed:
        click.echo(f"primerl-orch: killed {killed} sandbox(es) a previous run left", err=True)
    try:
        run(config)
    except (OrchestratorError, NoServerError, EnvLoadError, OSError) as err:  # OSError: a socket could not bind
        click.echo(f"primerl-orch: {err}", err=True)
        sys.exit(EXIT_FAILED)
    except KeyboardInterrupt:
        click.echo("primerl-orch: stopped", err=True)
        sys.exit(EXIT_FAILED)


def _eval_inference(config: EvalConfig):
    """The settings of the servers `primerl eval` starts: an admin token of their own when none
    is configured (to load a run's published steps: `primerl rl` makes one per run likewise);
    for a run that published LoRA adapters, LoRA serving on (unless the config says otherwise)
    with --max-lora-rank the smallest vLLM takes that holds the largest published rank
    (adapter_config.json's r and rank_pattern)."""
    import json
    import secrets

    import msgspec
    from primerl_inference.config import lora_rank_for
    from primerl_orchestrator.evals import published_steps
    from primerl_protocol.weights import ADAPTER, ADAPTER_CONFIG

    inference = config.inference
    if inference.resolved_admin_token() is None:
        inference = msgspec.structs.replace(inference, admin_token=secrets.token_urlsafe(24))
    if config.run is None or inference.enable_lora is False:
        return inference
    ranks = []
    for _, folder, _, fmt in published_steps(config.run):
        if fmt == ADAPTER:
            try:
                adapter = json.loads((folder / ADAPTER_CONFIG).read_text())
                ranks.append(max(int(r) for r in [adapter["r"], *(adapter.get("rank_pattern") or {}).values()]))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
                raise ValueError(f"{folder / ADAPTER_CONFIG}: not a readable PEFT adapter config ({err!r})") from None
    if not ranks:
        return inference
    fit = lora_rank_for(max(ranks))
    return msgspec.structs.replace(inference, enable_lora=True, max_lora_rank=inference.max_lora_rank or fit)


def _run_eval(config: EvalConfig) -> None:
    import asyncio

    import msgspec
    from primerl_envs import compat
    from primerl_envs.environment import EnvLoadError
    from primerl_inference.launcher import LaunchError, launch
    from primerl_orchestrator.evals import EvalError, eval_run, policy_label, published_steps
    from primerl_orchestrator.loop import configure_logging
    from primerl_orchestrator.servers import NoServerError
    from primerl_sandbox import claim_run

    configure_logging()
    try:  # before any server starts (the config's own checks ran when it loaded)
        if config.run is not None and not published_steps(config.run):
            raise ValueError(
                f"run = {config.run}: nothing to evaluate, no complete published weights ({config.run}/weights/step_N)"
            )
        inference = None if config.inference.urls else _eval_inference(config)
    except ValueError as err:
        click.echo(f"primerl eval: {err}", err=True)
        sys.exit(EXIT_CONFIG)
    # our own servers get free ports unless set (then refused if busy), as `primerl rl`'s
    own = None if inference is None else msgspec.structs.replace(config, inference=inference)
    checked = _check_here(
        "primerl eval", own or config, ports=True if own is not None else None, envs=("envs.eval", config.envs.eval)
    )
    inference = None if inference is None else checked.inference
    servers = None
    try:
        if inference is None:
            urls, token = config.inference.server_urls(), config.inference.resolved_admin_token()
        else:  # start our own servers for the eval
            assert config.model is not None, "EvalRunConfig.__post_init__ sets the model (given, or the run's)"
            servers = launch(inference, config.model.name, config.seq_len, config.run_dir)
            urls, token = servers.urls, inference.resolved_admin_token()
        compat.install()  # the process runs environments: primerl's patches of their packages, once
        claim_run()  # its environments' sandboxes are this eval's; a dead run's are killed
        results = asyncio.run(eval_run(config, urls, token))
    except (LaunchError, NoServerError, EnvLoadError, EvalError, ValueError) as err:
        click.echo(f"primerl eval: {err}", err=True)
        sys.exit(EXIT_FAILED)
    finally:
        if servers is not None:
            servers.stop()
    for r in results:
        scores = "  ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in r.items() if "@" in k)
        click.echo(f"{policy_label(r)}: {scores}")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="primerl")
def main() -> None:
    """primerl: asynchronous RL, SFT and evals for language models."""


for _name, _root, _summary, _engine, _slurm in [
    (
        "rl",
        RLConfig,
        "Run asynchronous RL: inference, orchestrator and trainer, on this machine (--slurm: on a cluster).",
        _run_rl,
        _render_rl,
    ),
    (
        "sft",
        SFTConfig,
        "Supervised fine-tuning on the FSDP2 trainer (one process; for several, "
        "torchrun --nproc-per-node N -m primerl.sft_entry @ cfg.toml, or --slurm).",
        _run_sft,
        _render("sft"),
    ),
    (
        "eval",
        EvalConfig,
        "Evaluate a model (or each published step of a run); results in run_dir/evals.jsonl.",
        _run_eval,
        _render("eval"),
    ),
]:
    main.add_command(config_command(_name, _root, _summary, _engine, prog=f"primerl {_name}", slurm=_slurm))


@main.command(
    "plan",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": ["-h", "--help"]},
)
@click.option("--slurm", "slurm_job", is_flag=True, help="Plan the run as its Slurm job (slurm.* nodes and GPUs).")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def plan(slurm_job: bool, args: tuple[str, ...]) -> None:
    """Whether an RL run fits its GPUs: per trainer rank and per inference GPU, what each part
    takes (with trainer.optimizer.cpu_offload, what a node's trainer ranks keep in host memory,
    against plan.host_memory_gib or this machine's), and layouts that fit when it does not
    (exit 2). `primerl rl` makes the same check before it starts (plan.check).

    \b
    primerl plan @ cfg.toml [key=value ...] [--slurm]
    """
    from primerl.errors import CheckError
    from primerl.plan import plan_for_launch

    try:
        config = load_config(RLConfig, args)
    except ConfigError as err:
        click.echo(f"primerl plan: config error: {err}", err=True)
        sys.exit(EXIT_CONFIG)
    try:
        if not slurm_job and config.inference.device == "auto":
            from primerl_inference.launcher import resolve_device

            config = msgspec.structs.replace(
                config, inference=msgspec.structs.replace(config.inference, device=resolve_device(config.inference))
            )
        result = plan_for_launch(config, slurm=slurm_job)
    except CheckError as err:
        click.echo(f"primerl plan: {err}", err=True)
        sys.exit(EXIT_CONFIG)
    if result is None:
        click.echo(
            "primerl plan: a CPU run (inference.device = cpu, or slurm.gpus_per_node = 0): no GPU memory to plan"
        )
        return
    click.echo(result.render())
    why = result.refusal()
    if why is not None:
        click.echo(f"primerl plan: the run does not fit: {why}", err=True)
        sys.exit(EXIT_CONFIG)


@main.command("report", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option(
    "--window",
    default=20,
    show_default=True,
    help="Steps in the reward's moving average and the summary's first/last means.",
)
def report(run_dir: str, window: int) -> None:
    """PNG plots (reward, loss, mismatch KL, entropy, completion length, errored/truncated/
    filtered rollouts, grad norm, lr, tokens/s, off-policy level, time split, evals) and a text
    summary of a run, written to RUN_DIR/report/ (for runs without Weights & Biases; metric
    names: docs/metrics.md)."""
    from primerl.report import ReportError, write_report

    try:
        out = write_report(run_dir, window)
    except ReportError as err:
        click.echo(f"primerl report: {err}", err=True)
        sys.exit(EXIT_FAILED)
    click.echo((out / "summary.txt").read_text(), nl=False)
    click.echo(f"plots and summary in {out}")


@main.command("merge-lora", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("base", type=click.Path(file_okay=False))
@click.argument("adapter", type=click.Path(file_okay=False))
@click.argument("out", type=click.Path())
@click.option(
    "--dtype",
    type=click.Choice(["auto", "bfloat16", "float16", "float32"]),
    default="auto",
    show_default=True,
    help="The merged weights' dtype (auto: the base config's torch_dtype).",
)
@click.option(
    "--allow-base-mismatch",
    is_flag=True,
    help="Merge even though the adapter's base_model_name_or_path names another model than BASE "
    "(BASE is that model under another name). Shapes are checked regardless.",
)
def merge_lora(base: str, adapter: str, out: str, dtype: str, allow_base_mismatch: bool) -> None:
    """Merge a LoRA adapter (a run's published RUN_DIR/weights/step_N, or any PEFT LoRA adapter
    folder) into its BASE model folder: a full Hugging Face checkpoint in OUT, for export or
    for serving without LoRA. Refused (exit 2, nothing written): an adapter whose
    base_model_name_or_path names another model than BASE (neither the same folder nor the same
    name), an adapted layer whose A/B do not fit BASE's weight, a modified published folder, an
    existing OUT."""
    from primerl_trainer.adapters import export_merged

    try:
        folder = export_merged(
            base, adapter, out, None if dtype == "auto" else dtype, check_base_model=not allow_base_mismatch
        )
    except (ValueError, FileNotFoundError) as err:
        click.echo(f"primerl merge-lora: {err}", err=True)
        sys.exit(EXIT_CONFIG)
    click.echo(f"merged model in {folder}")


orch_main = config_command(
    "primerl-orch",
    OrchRunConfig,
    "The orchestrator: the asynchronous rollout loop.",
    _run_orchestrator,
)
trainer_main = config_command(
    "primerl-trainer",
    TrainerRunConfig,
    "The RL trainer. Launch with torchrun: torchrun --nproc-per-node N -m primerl.trainer_entry @ cfg.toml",
    _run_trainer,
)
inference_main = config_command(
    "primerl-inference",
    InferenceRunConfig,
    "vLLM inference servers with primerl's admin routes; prints their addresses and serves until Ctrl-C.",
    _run_inference,
)
