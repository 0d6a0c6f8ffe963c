"""``job``: the command-line edge. Options are parsed and validated here, once, into config dataclasses.

Every option can also be set with an environment variable ``JOB_<OPTION>`` (e.g. ``JOB_MAX_DURATION``)
so Kubernetes manifests can configure the job without changing its command. Errors print one line
and exit with the code documented in :mod:`job.exceptions`.
"""
from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import tempfile
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, NoReturn

import click
from click.core import ParameterSource
import torch

from job import distributed
from job.config import MAX_WORKERS, CheckpointConfig, TrainConfig
from job.distributed import DistConfig
from job.entry import STOP_SIGNALS, stopped_before_start
from job.exceptions import EXIT_BUG, EXIT_PREEMPTED, EXIT_USAGE, ConfigError, JobError, exit_code_for
from job.logs import setup_logging
from job.schedule import Interval
from job.signals import StopRequest
from job.spot import SpotWatcher, check_endpoint, make_source
from job.storage import UPLOAD_MODES, RemoteConfig
from state import SEED_LIMIT, Precision, PrecisionError, Time, TimeUnit
from uploader.cli import Folder, Seconds, report_click_error
from uploader.config import ADDRESSING_STYLES, UploadConfig
from uploader.exceptions import UploaderError
from uploader.redact import redact_text
from uploader.remote import Remote

logger = logging.getLogger(__name__)


def option(name: str, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A click option with its ``JOB_*`` environment variable and default shown in --help."""
    envvar = "JOB_" + name.split("/")[0].lstrip("-").replace("-", "_").upper()
    kwargs.setdefault("show_default", "none" if kwargs.get("default", ...) is None else True)  # not a blank
    return click.option(name, envvar=envvar, show_envvar=True, **kwargs)


class TimeType(click.ParamType):
    name = "TIME"

    def convert(self, value: Any, param: Any, ctx: Any) -> Time:
        if isinstance(value, Time):
            return value
        try:
            return Time.from_timestring(str(value))
        except ValueError as e:
            self.fail(f"{e}; examples: 10ep, 500ba, 2048sp, 1e6tok", param, ctx)


class IntervalType(click.ParamType):
    name = "INTERVAL"

    def __init__(self, wall_clock: bool = True) -> None:
        self.wall_clock = wall_clock

    def convert(self, value: Any, param: Any, ctx: Any) -> Interval:
        if isinstance(value, Interval):
            return value
        try:
            return Interval.parse(str(value), allow_wall_clock=self.wall_clock)
        except ValueError as e:
            self.fail(str(e), param, ctx)


def torchrun_env() -> DistConfig:
    """torchrun's variables (WORLD_SIZE, RANK, LOCAL_RANK); a plain start is one process of one."""
    env = os.environ

    def number(name: str, default: str) -> int:
        value = env.get(name, default)
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{name}={value!r} is not a whole number: torchrun sets it; start the job with "
                              "torchrun, or unset it for one process") from None

    try:
        return DistConfig(world_size=number("WORLD_SIZE", "1"), rank=number("RANK", "0"),
                          local_rank=number("LOCAL_RANK", "0"), master_addr=env.get("MASTER_ADDR", ""),
                          master_port=number("MASTER_PORT", "0"),
                          attempt=number("TORCHELASTIC_RESTART_COUNT", "0"),
                          agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
                          node_rank=number("GROUP_RANK", "0"),
                          local_world_size=number("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda, but no CUDA GPU is visible; run with --gpus / a GPU node, or --device cpu")
    return device


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="spot-trainer")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """spot-trainer: PyTorch training that survives preemption."""
    if ctx.invoked_subcommand not in STOPPED_TO_RESUME:
        _usual_signal_handlers()


# The commands that a stop signal ends with exit 75 before they can answer it (job.entry): `job train` until its
# loop's handler, `job launch` until torchrun has started its workers and handles the signal itself (job.launch),
# through its rendezvous (the wait for the other nodes) too, whose C++ waits the wakeup thread sees through.
STOPPED_TO_RESUME = ("train", "launch")


def _usual_signal_handlers() -> None:
    """Python's own SIGTERM and SIGINT handling for the other commands: job.entry's exit 75 means "stopped,
    to be resumed", which `job inspect` or `job report` never are. Only where job.entry installed its handler."""
    for sig, usual in ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGINT, signal.default_int_handler)):
        if signal.getsignal(sig) is stopped_before_start:
            signal.signal(sig, usual)


def _dump_stacks_on_sigusr1() -> None:
    """A job that seems stuck (a collective no peer enters, a hung mount) shows where on `kill -USR1`.

    Not faulthandler.register: its handler walks every thread's frames from inside the signal handler,
    while those threads run, and can crash the job it was asked to look at (CPython gh-116008; seen in
    this project's CI: SIGSEGV while printing the TensorBoard writer's stack). Here the signal only wakes
    a thread (CPython's own handler writes the signal number to the wakeup fd, from whatever the main
    thread is doing), which prints every stack holding the GIL, so no frame changes under it; a thread
    stuck in a collective or on a mount has released the GIL and shows where. The output is
    faulthandler's, to the process's own stderr descriptor, even where sys.stderr was replaced (click's
    test runner, an embedding program). Once per process; a program that already uses the wakeup fd
    (asyncio) keeps it, and gets no stack dumps."""
    global _stack_dumps
    if _stack_dumps:
        return
    stream = sys.__stderr__ if sys.__stderr__ is not None else sys.stderr
    read_fd, write_fd = os.pipe()
    try:
        stream.fileno()
        os.set_blocking(write_fd, False)
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        if previous != -1:
            signal.set_wakeup_fd(previous)
            raise ValueError("the signal wakeup fd is already in use")
        try:
            signal.signal(signal.SIGUSR1, _wake_only)  # with a Python handler, CPython's writes to the wakeup fd
        except BaseException:
            signal.set_wakeup_fd(-1)  # before its pipe is closed below
            raise
    except (AttributeError, ValueError, OSError) as e:  # no stderr descriptor, not the main thread
        os.close(read_fd)
        os.close(write_fd)
        logger.debug("no stack dumps on SIGUSR1: %s", e)
        return
    _stack_dumps = True
    threading.Thread(target=_print_stacks_on_wakeup, args=(read_fd, stream), name="stack-dumps", daemon=True).start()
    os.register_at_fork(after_in_child=lambda: _dump_stacks_in_child(stream))


_stack_dumps = False


def _wake_only(signum: int, frame: Any) -> None:
    """SIGUSR1's Python-level handler: nothing; the stacks are printed by the thread it wakes."""


def _print_stacks_on_wakeup(read_fd: int, stream: Any) -> None:
    """Also job.entry's stop before training, from here: its Python handler runs only when the main thread
    runs Python, and torchrun's rendezvous holds it in C++ until every node has joined (the handler alone
    would answer a SIGTERM there only after the whole wait, long past any grace period)."""
    while data := os.read(read_fd, 64):  # the numbers of the signals received, a byte each
        if signal.SIGUSR1 in data:
            faulthandler.dump_traceback(file=stream, all_threads=True)
        for sig in STOP_SIGNALS:
            if sig in data and signal.getsignal(sig) is stopped_before_start:  # not yet the loop's StopRequest
                stopped_before_start(sig, None)


def _dump_stacks_in_child(stream: Any) -> None:
    """A forked child (a DataLoader worker) has no thread to wake and one thread of Python: faulthandler's
    own handler is safe there, and the wakeup fd is the parent's."""
    try:
        signal.set_wakeup_fd(-1)
        faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)
    except (ValueError, OSError, RuntimeError) as e:
        logger.debug("no stack dumps on SIGUSR1 in a forked child: %s", e)


@cli.command()
@option("--model", default="mlp", help="Built-in model (mlp, mlp-large) or pkg.module:function returning an nn.Module.")
@option("--data", default="spirals", help="Built-in data (spirals) or pkg.module:function(split) returning a Dataset.")
@option("--max-duration", type=TimeType(), default="12ep", help="How long to train: ep, ba, sp or tok.")
@option("--batch-size", type=click.IntRange(min=1), default=64, help="Samples per optimizer step.")
@option("--lr", type=float, default=3e-3, help="Peak learning rate (AdamW, cosine decay).")
@option("--seed", type=click.IntRange(0, SEED_LIMIT - 1), default=17, help="Seed of rank 0 (rank r uses seed + r).")
@option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", help="auto: cuda when present.")
@option("--precision", type=click.Choice([p.value for p in Precision]), default="fp32", help="amp_* need a GPU.")
@option("--grad-accum", type=click.IntRange(min=1), default=1,
        help="Micro-batches per optimizer step (divides --batch-size).")
@option("--eval-interval", type=IntervalType(), default="1ep",
        help="Evaluate every N ba/ep, a fraction of --max-duration (0.25dur) or wall-clock (90s).")
@option("--log-interval", type=click.IntRange(min=1), default=20, help="Log progress every N batches.")
@option("--num-workers", type=click.IntRange(0, MAX_WORKERS), default=0, help="DataLoader worker processes.")
@option("--sharded/--no-sharded", default=False,
        help="FSDP2: shard parameters and optimizer state across torchrun ranks; each rank writes its own shard.")
@option("--tensorboard/--no-tensorboard", default=True,
        help="Write training curves (loss, lr, throughput, eval, checkpoint stall) as TensorBoard event files "
             "under <save-folder>/runlog/tensorboard, uploaded with the checkpoints; one clean curve across resumes.")
@option("--save-folder", type=Folder(), default=Path("checkpoints"),
        help="Local checkpoint folder.")
@option("--save-interval", type=IntervalType(), default="5m",
        help="Checkpoint every N ba/ep, a fraction of --max-duration (0.1dur) or wall clock (90s, 5m).")
@option("--keep", type=click.IntRange(min=1), default=3,
        help="Keep the newest N checkpoints, locally and in the remote.")
@option("--async-save/--sync-save", default=True,
        help="async: block only for a copy into host memory and write in the background (a checkpoint due "
             "while the last is still being written is deferred to the first step after it, never waited "
             "for); sync: every checkpoint durable before training goes on.")
@option("--resume", default="auto",
        help="auto (newest complete checkpoint), never, or a checkpoint folder PATH to start from (until the run has "
             "checkpoints of its own).")
@option("--remote", default=None, show_default="none: checkpoints stay in --save-folder",
        help="s3://bucket/prefix or file:///path: pull on start-up, upload checkpoints.")
@option("--upload", type=click.Choice(UPLOAD_MODES), default="inprocess",
        help="inprocess: upload in a background thread; sidecar: leave it to `uploader watch`; off.")
@option("--final-upload-timeout", type=Seconds(min=0, min_open=True), default=600.0,
        help="At the end of training, seconds to wait for the final checkpoint's upload before exiting 5 "
             "(the checkpoint stays in --save-folder for the next start or a sidecar).")
@option("--endpoint-url", default=None, show_default="AWS_ENDPOINT_URL, else AWS",
        help="S3 endpoint (MinIO, SeaweedFS, ...).")
@option("--addressing", type=click.Choice(ADDRESSING_STYLES), default="auto", help="S3 addressing; path for MinIO.")
@option("--grace-period", type=Seconds(min=0), default=25.0,
        help="Seconds from SIGTERM to exit: final checkpoint and upload must fit (k8s default grace is 30 s).")
@option("--spot-notice", type=click.Choice(["off", "aws", "gcp", "auto"]), default="off",
        help="Poll the cloud metadata server for spot interruption notices.")
@option("--spot-endpoint", default=None, show_default="the cloud's own", help="Metadata server base URL.")
@option("--spot-poll-interval", type=Seconds(min=0.1), default=5.0, help="Seconds between notice polls.")
@option("--log-format", type=click.Choice(["auto", "text", "json"]), default="auto",
        help="auto: text on a terminal, JSON lines otherwise.")
@option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
        help="Least severe log records shown (stderr).")
def train(**o: Any) -> None:
    """Train, checkpointing atomically, resuming from the newest complete checkpoint.

    Under torchrun (env:// rendezvous) each process trains one shard of every batch with DDP.
    """
    if os.environ.get("JOB_SAVE_FOLDER") == "" and (
            click.get_current_context().get_parameter_source("save_folder") is ParameterSource.DEFAULT):
        # click drops an empty variable: the default, ./checkpoints, in a container its own writable layer,
        # which goes with the container and the checkpoints with it (a `$(LOCAL)` that expanded to nothing).
        raise ConfigError("JOB_SAVE_FOLDER is set but empty: give it a folder, or unset it for the default "
                          "./checkpoints")
    dist_cfg = torchrun_env()
    # Under torchrun only rank 0 tells the story, and on several nodes each node's leader too, in its own
    # pod's log (its uploads, its pull); the other ranks speak up for warnings and errors.
    speaks = dist_cfg.rank == 0 or (dist_cfg.local_rank == 0 and dist_cfg.nodes > 1)
    setup_logging(o["log_format"], o["log_level"] if speaks else "warning")
    _dump_stacks_on_sigusr1()
    if dist_cfg.enabled and o["eval_interval"].seconds is not None:
        raise ConfigError("--eval-interval in seconds cannot be used with torchrun (ranks must evaluate at the "
                          "same step); use ba or ep")
    try:
        # `dur` intervals are fractions of this start's --max-duration (a resume may change it): resolved
        # here where that alone decides, otherwise once the data is built (Interval.resolve).
        eval_interval = _resolved("--eval-interval", o["eval_interval"], o["max_duration"])
        save_interval = _resolved("--save-interval", o["save_interval"], o["max_duration"])
        cfg = TrainConfig(
            model=o["model"], data=o["data"], max_duration=o["max_duration"], batch_size=o["batch_size"],
            lr=o["lr"], seed=o["seed"], device=resolve_device(o["device"]), precision=Precision(o["precision"]),
            grad_accum=o["grad_accum"], eval_interval=eval_interval, log_interval=o["log_interval"],
            num_workers=o["num_workers"], sharded=o["sharded"], tensorboard=o["tensorboard"],
        )
        ckpt = CheckpointConfig(folder=o["save_folder"], interval=save_interval, keep=o["keep"], resume=o["resume"],
                                async_save=o["async_save"])
        remote = RemoteConfig(url=o["remote"], mode=o["upload"], upload=UploadConfig(
            endpoint_url=o["endpoint_url"], addressing=o["addressing"], keep=o["keep"]),
            final_upload_timeout=o["final_upload_timeout"])
        check_endpoint(o["spot_endpoint"])
    except (ValueError, PrecisionError) as e:
        raise ConfigError(str(e)) from None
    if speaks:
        _warn_unused(o)
    if cfg.sharded and not dist_cfg.enabled:
        raise ConfigError("--sharded splits the model across torchrun's processes: start the job with "
                          "torchrun --nproc-per-node N (N >= 2), or drop --sharded")
    if cfg.seed + dist_cfg.world_size > SEED_LIMIT:
        raise ConfigError(f"--seed {cfg.seed}: rank r seeds with seed + r, and rank {dist_cfg.world_size - 1} "
                          f"would pass {SEED_LIMIT - 1}; use a seed below {SEED_LIMIT - dist_cfg.world_size + 1}")
    from job.app import train as run_training

    # The ranks that upload nothing wait in a collective while the others wait for the final upload (at the end
    # of training, or within the grace period at a preemption).
    uploads_here = bool(remote.url) and remote.mode == "inprocess"
    extra = max(remote.final_upload_timeout, o["grace_period"]) if uploads_here else 0.0
    distributed.init(replace(dist_cfg, timeout_s=distributed.COLLECTIVE_TIMEOUT_S + extra), cfg.device)
    stop = StopRequest(grace_period=o["grace_period"])
    stop.install()
    source = make_source(o["spot_notice"], o["spot_endpoint"])
    spot = SpotWatcher(source, o["spot_poll_interval"]) if source is not None else None
    if spot is not None:
        spot.start()
    try:
        outcome = run_training(cfg, ckpt, remote, stop=stop, spot=spot)
    finally:
        if spot is not None:
            spot.close()
        stop.uninstall()
        distributed.shutdown()
    if outcome.preempted:
        # At once: the kill is due, everything is written (and a write still in flight is cleaned up by the next
        # start), and the interpreter's own teardown takes about a second with torch loaded.
        exit_now(EXIT_PREEMPTED)


# Options that only matter with another one: given without it (a typo'd variable, a manifest half-edited),
# they did nothing and said nothing.
NEEDS = {
    ("remote", None): ("upload", "endpoint_url", "addressing", "final_upload_timeout"),
    ("spot_notice", "off"): ("spot_endpoint", "spot_poll_interval"),
}


def _warn_unused(o: dict[str, Any]) -> None:
    """One warning per option set (flag or JOB_* variable) that has no effect without another (NEEDS)."""
    ctx = click.get_current_context()
    for (needed, off), options in NEEDS.items():
        if (o[needed] or None) != off:  # an empty --remote is none
            continue
        given = [name for name in options
                 if ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)]
        other = "--" + needed.replace("_", "-")
        without = f"without {other}" if off is None else f"with {other} {off}"
        for name in given:
            flag = "--" + name.replace("_", "-")
            logger.warning("%s has no effect %s (given as a flag or JOB_%s); ignoring it", flag, without, name.upper())


def _resolved(flag: str, interval: Interval, max_duration: Time) -> Interval:
    """``interval`` resolved against --max-duration as far as the options allow; errors name the flag."""
    if max_duration.unit == TimeUnit.DURATION:  # refused by TrainConfig, with its own message
        return interval
    try:
        return interval.resolve(max_duration)
    except ValueError as e:
        raise ValueError(f"{flag} {e}") from None


def exit_now(code: int) -> NoReturn:
    """Exit with ``code`` while a daemon thread is still inside torch: a normal interpreter shutdown
    would stop that thread mid-C++ and the runtime aborts the process (SIGABRT), losing the code
    that Kubernetes' podFailurePolicy reads."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("torchrun_args", nargs=-1, type=click.UNPROCESSED)
def launch(torchrun_args: tuple[str, ...]) -> None:
    """torchrun, exiting with its workers' exit code instead of torchrun's 1.

    Takes torchrun's arguments, e.g. `job launch --nnodes 2 --nproc-per-node 8 -m job train`. A failed
    worker's code (2 bad flags, 6 an unusable checkpoint, 75 stopped by a spot notice, ...) becomes the
    launcher's, as Kubernetes' podFailurePolicy needs; SIGTERM or SIGINT to the launcher is 75.
    """
    _dump_stacks_on_sigusr1()  # also ends a stop held in torchrun's rendezvous, in C++ (job.entry)
    from job.launch import launch as run_torchrun

    sys.exit(run_torchrun(torchrun_args))


@cli.command()
@click.argument("path")
@option("--endpoint-url", default=None, show_default="AWS_ENDPOINT_URL, else AWS", help="S3 endpoint for s3:// paths.")
@option("--addressing", type=click.Choice(ADDRESSING_STYLES), default="auto", help="S3 addressing style.")
def inspect(path: str, endpoint_url: str | None, addressing: str) -> None:
    """Print one JSON line about a checkpoint: step, epoch, samples, model_sha256.

    PATH is a checkpoint folder, a folder of checkpoints, or a remote URL (s3://bucket/prefix,
    file:///path); for the last two the newest complete checkpoint is used.
    """
    from job.checkpoint import describe, open_checkpoint

    if not path.strip():  # Path("") is ".": a variable that expanded to nothing inspected the working folder
        raise ConfigError("job inspect: PATH is empty: give a checkpoint folder, a folder of checkpoints or a URL")
    if "://" in path:
        with tempfile.TemporaryDirectory(prefix="job-inspect-") as tmp:
            info = describe_remote(path, Path(tmp), endpoint_url, addressing)
    else:
        folder, manifest = open_checkpoint(Path(path))
        info = describe(folder, manifest)
    click.echo(json.dumps(info, sort_keys=True))


@cli.command()
@click.argument("source")
@option("--format", type=click.Choice(["text", "json"]), default="text", help="A table, or JSON for scripts.")
@option("--plot", type=click.Path(dir_okay=False, path_type=Path), default=None,
        help="Also write a timeline of the lives as an SVG file (one bar per life).")
@option("--endpoint-url", default=None, show_default="AWS_ENDPOINT_URL, else AWS",
        help="S3 endpoint for s3:// sources.")
@option("--addressing", type=click.Choice(ADDRESSING_STYLES), default="auto", help="S3 addressing style.")
def report(source: str, format: str, plot: Path | None, endpoint_url: str | None,  # noqa: A002 - click's name
           addressing: str) -> None:
    """What preemption cost a run: its lives and the goodput breakdown, from its ledger.

    SOURCE is the run's --remote (s3://bucket/prefix, file:///path) or its --save-folder. Only reads:
    read-only credentials are enough. Malformed ledger entries are skipped and listed.
    """
    from job import report as reporting

    if plot is not None and plot.suffix.lower() != ".svg":
        raise ConfigError(f"--plot {plot}: only .svg is written (it opens in any browser)")
    url = source if "://" in source else Path(source).resolve().as_uri()
    if "://" not in source and not Path(source).is_dir():
        raise ConfigError(f"{source} is not a folder or a remote URL (s3://bucket/prefix, file:///path)")
    remote = open_source(url, endpoint_url, addressing)
    try:
        lives, skipped = reporting.load(remote)
    finally:
        remote.close()
    if not lives and not skipped:
        raise ConfigError(f"no ledger under {source} (runlog/ledger/): is it the run's --remote or --save-folder?")
    per_life = reporting.costs(lives)
    if plot is not None:
        try:
            reporting.write_plot(plot, per_life)
        except OSError as e:
            raise ConfigError(f"--plot {plot}: cannot write it ({e.strerror or e}): name a file in an existing "
                              "folder this user may write") from None
    if format == "json":
        click.echo(json.dumps(reporting.as_json(per_life, skipped), sort_keys=True))
    else:
        click.echo(reporting.as_text(per_life, skipped))


def open_source(url: str, endpoint_url: str | None, addressing: str) -> Remote:
    """The remote a command reads (inspect, report): a malformed URL or endpoint is bad usage (exit 2)."""
    from uploader.remote import open_remote

    try:
        return open_remote(url, UploadConfig(endpoint_url=endpoint_url, addressing=addressing))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def describe_remote(url: str, tmp: Path, endpoint_url: str | None, addressing: str) -> dict[str, Any]:
    """Pull the newest complete, verified checkpoint under ``url`` into ``tmp`` and describe it."""
    from job.checkpoint import describe, open_checkpoint
    from uploader.exceptions import NoCheckpointFound
    from uploader.sync import pull_newest

    remote = open_source(url, endpoint_url, addressing)
    try:
        pulled = pull_newest(remote, tmp, set_aside_corrupt=False)  # inspect only reads
    finally:
        remote.close()
    if pulled is None:
        raise NoCheckpointFound(f"no complete checkpoint under {url}")
    info = describe(*open_checkpoint(pulled.path))
    info["path"] = f"{url.rstrip('/')}/{pulled.name}"
    return info


def main(argv: list[str] | None = None) -> NoReturn:
    """Entry point: click errors and JobErrors become one line on stderr and a documented exit code."""
    code = run(argv)
    if distributed.joined():  # a torchrun worker: see job.distributed.joined for why it skips the teardown
        exit_now(code)
    sys.exit(code)


def run(argv: list[str] | None) -> int:
    """The CLI, with every way out turned into an exit code (errors printed as one line)."""
    try:
        code = cli.main(args=argv, prog_name="job", standalone_mode=False)
    except SystemExit as e:  # sys.exit inside a command
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        click.echo(e.code, err=True)
        return 1
    except click.ClickException as e:
        return report_click_error("job", e) or EXIT_USAGE
    except click.exceptions.Abort:
        click.echo("job: aborted", err=True)
        return 130
    except (JobError, UploaderError, PrecisionError) as e:
        logger.debug("job error", exc_info=True)
        click.echo(f"job: error: {redact_text(str(e))}", err=True)
        return exit_code_for(e)
    except Exception:
        logger.exception("unexpected error (a bug: please report it with this traceback)")
        return EXIT_BUG
    return code if isinstance(code, int) else 0
