"""``uploader``: sync checkpoints between a local folder and S3 (or a shared volume).

    uploader sync  LOCAL REMOTE   upload every committed checkpoint not yet complete remotely, once
    uploader watch LOCAL REMOTE   sidecar: upload each new checkpoint until SIGTERM or the job finishes
    uploader pull  REMOTE LOCAL   download the newest complete, verified checkpoint
    uploader ls    REMOTE         list remote checkpoints (table on a terminal, JSON lines otherwise)

REMOTE is ``s3://bucket/prefix`` or ``file:///absolute/path``. Every option can also be set with
an ``UPLOADER_<OPTION>`` environment variable (shown in --help). Credentials come only from the
standard AWS chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, web identity/IRSA, instance
profile); the endpoint from --endpoint-url or AWS_ENDPOINT_URL.

Exit codes:

    0  success (watch: stopped by SIGTERM/SIGINT, or the job finished, with everything committed uploaded)
    1  unexpected error (a storage error none of the below, or a bug)
    2  usage: a bad option, value or remote URL
    3  authentication or permission: missing or wrong credentials, access denied, a file:// folder this user may not
       write, a local checkpoint it may not read
    4  the bucket (for file://, the folder above the remote path) does not exist
    5  storage unreachable or failing after every retry (watch: grace period over before the upload ended)
    6  no complete checkpoint found, or the checkpoint is corrupt; or a remote entry an upload must not
       replace (a newer build's checkpoint, something else in an object's place)
    7  pull: the local folder cannot take the download (disk full, quota, file size limit, read-only)

Errors are one line on stderr, without a traceback (``--log-level debug`` logs it).
"""
from __future__ import annotations

import logging
import math
import os
import re
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import click

from uploader.config import ADDRESSING_STYLES, UploadConfig
from uploader.console import print_checkpoints, setup_logging
from uploader.exceptions import (
    Aborted,
    AuthError,
    BadSettings,
    BucketNotFound,
    CorruptCheckpoint,
    LocalWriteError,
    ManifestError,
    NoCheckpointFound,
    RemoteInTheWay,
    TransientStorageError,
    UploaderError,
)
from uploader.local import list_committed, nearest_existing
from uploader.redact import redact_text
from uploader.remote import Remote, open_remote
from uploader.sync import list_remote, list_set_aside, pull_newest, push_all
from uploader.watch import watch as watch_loop

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_UNEXPECTED = 1
EXIT_USAGE = 2
EXIT_AUTH = 3
EXIT_NO_BUCKET = 4
EXIT_UNREACHABLE = 5
EXIT_NO_CHECKPOINT = 6
EXIT_LOCAL_WRITE = 7  # the job's EXIT_WRITE_FAILED: the same failure, the same code

_EXIT_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (BadSettings, EXIT_USAGE),
    (AuthError, EXIT_AUTH),
    (BucketNotFound, EXIT_NO_BUCKET),
    (TransientStorageError, EXIT_UNREACHABLE),
    (Aborted, EXIT_UNREACHABLE),
    (NoCheckpointFound, EXIT_NO_CHECKPOINT),
    (CorruptCheckpoint, EXIT_NO_CHECKPOINT),
    (ManifestError, EXIT_NO_CHECKPOINT),
    (RemoteInTheWay, EXIT_NO_CHECKPOINT),
    (LocalWriteError, EXIT_LOCAL_WRITE),
)


def exit_code(exc: BaseException) -> int:
    for cls, code in _EXIT_CODES:
        if isinstance(exc, cls):
            return code
    return EXIT_UNEXPECTED


class Size(click.ParamType):  # type: ignore[type-arg]  # generic only from click 8.2 on
    """Bytes, with an optional binary unit: 16MiB, 16M, 1GiB, 4096."""

    name = "size"
    _UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        m = re.fullmatch(r"\s*(\d+)\s*([kmg]?)(?:i?b)?\s*", str(value), re.IGNORECASE)
        if not m:
            self.fail(f"{value!r} is not a size such as 16MiB or 1048576", param, ctx)
        return int(m.group(1)) * self._UNITS[m.group(2).lower()]


class Seconds(click.FloatRange):
    """A number of seconds within bounds, and finite: click's FloatRange lets nan through every bound
    (a poll interval of nan polled without a pause), and a wait of inf or 1e308 seconds overflows
    time_t or the thread wait's limit (threading.TIMEOUT_MAX), also with the margins added to it."""

    LIMIT = 1e9  # 31 years, far below threading.TIMEOUT_MAX (292 years on Linux) and time_t

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        seconds = super().convert(value, param, ctx)
        if not math.isfinite(seconds) or seconds > self.LIMIT:
            self.fail(f"{value!r} is not a number of seconds a wait can take (finite, at most {self.LIMIT:.0e})",
                      param, ctx)
        return seconds


F = TypeVar("F", bound=Callable[..., Any])


def report_click_error(prog: str, e: click.ClickException) -> int:
    """click's usage errors as one stderr line, like every other error (click's own form is three:
    Usage, Try, Error); a bare command still gets its help. Returns the exit code. The job's CLI uses it too."""
    if type(e).__name__ == "NoArgsIsHelpError":  # click >= 8.2: the "error" is the help text
        e.show()
        return e.exit_code
    ctx = getattr(e, "ctx", None)
    command = ctx.command_path if ctx is not None else prog
    click.echo(redact_text(f"{prog}: error: {e.format_message()} (see '{command} --help')"), err=True)
    return e.exit_code


def option(*decls: str, **kwargs: Any) -> Callable[[F], F]:
    """click.option with the UPLOADER_<OPTION> environment variable, shown in --help with the default."""
    name = decls[0].lstrip("-").replace("-", "_").upper()
    kwargs.setdefault("show_default", "none" if kwargs.get("default", ...) is None else True)  # not a blank
    return click.option(*decls, envvar=f"UPLOADER_{name}", show_envvar=True, **kwargs)


class _Main(click.Group):
    """Turns our exceptions, and click's usage errors, into one stderr line and the documented exit code."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as e:
            raise SystemExit(report_click_error("uploader", e)) from None
        except click.exceptions.Abort:
            click.echo("uploader: aborted", err=True)
            raise SystemExit(130) from None
        raise SystemExit(code if isinstance(code, int) else 0)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except UploaderError as e:
            self._fail(e, exit_code(e))
        except Exception as e:  # noqa: BLE001 - one line instead of a traceback, as promised
            self._fail(e, EXIT_UNEXPECTED, prefix=f"unexpected {type(e).__name__}: ")

    @staticmethod
    def _fail(e: BaseException, code: int, prefix: str = "") -> None:
        logger.debug("details", exc_info=e)  # the console's handlers redact URLs in it too
        # Our own messages are secret-free already; an unexpected exception's text may hold a URL.
        line = redact_text(" ".join(str(e).split())) or type(e).__name__
        click.echo(f"uploader: error: {prefix}{line}", err=True)
        raise click.exceptions.Exit(code)


EPILOG = """\b
Exit codes: 0 ok; 1 unexpected; 2 usage; 3 auth/permission; 4 bucket missing;
5 storage unreachable after retries (watch: grace over); 6 no checkpoint found / corrupt;
7 a download cannot be written locally (disk full, read-only)."""


@click.group(cls=_Main, epilog=EPILOG,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@option("--endpoint-url", default=None, show_default="AWS_ENDPOINT_URL, else AWS",
        help="S3 endpoint, e.g. http://minio:9000.")
@option("--region", default=None, show_default="boto3's, e.g. AWS_DEFAULT_REGION", help="Region for signing.")
@option("--addressing", type=click.Choice(ADDRESSING_STYLES), default="auto",
        help="Bucket addressing; 'path' for MinIO/SeaweedFS behind one host name.")
@option("--max-attempts", type=click.IntRange(min=1), default=8, help="Attempts per request (1 = no retry).")
@option("--max-retry-seconds", type=Seconds(min=0, min_open=True), default=120.0,
        help="Wall-clock limit on one request, all its attempts together (keep it above the time one part takes).")
@option("--connect-timeout", type=Seconds(min=0, min_open=True), default=10.0, help="Seconds.")
@option("--read-timeout", type=Seconds(min=0, min_open=True), default=60.0, help="Seconds.")
@option("--multipart-threshold", type=Size(), default="64MiB", help="Files this large go up in parts.")
@option("--part-size", type=Size(), default="16MiB", help="Size of one part (at least 5MiB).")
@option("--concurrency", type=click.IntRange(1, 64), default=8, help="Parts in flight per file.")
@option("--keep", type=click.IntRange(min=1), default=3, help="Complete remote checkpoints to keep.")
@option("--log-level", type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
        default="info", help="Logs go to stderr: text on a terminal, JSON lines otherwise.")
@click.pass_context
def main(ctx: click.Context, /, log_level: str, **settings: Any) -> None:
    """Sync spot-trainer checkpoints with S3 (s3://bucket/prefix) or a shared volume (file:///path).

    Credentials come from the standard AWS chain only; the endpoint from --endpoint-url or AWS_ENDPOINT_URL.
    """
    setup_logging(log_level)
    try:
        ctx.obj = UploadConfig(**settings)
    except ValueError as e:
        raise click.UsageError(str(e)) from None


def _open(url: str, config: UploadConfig) -> Remote:
    try:
        return open_remote(url, config)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="REMOTE") from None


class Folder(click.Path):
    """A local folder, never an empty string: a variable set to nothing (``$(LOCAL)`` in a pod's args,
    ``JOB_SAVE_FOLDER=``) was the working directory, in a container its own writable layer, which goes with
    the container and the checkpoints with it."""

    def __init__(self, exists: bool = False) -> None:
        super().__init__(exists=exists, file_okay=False, path_type=Path)

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if isinstance(value, str) and not value.strip():
            self.fail("is empty; give a folder (. for the working directory)", param, ctx)
        return super().convert(value, param, ctx)


LOCAL = Folder()
EXISTING_LOCAL = Folder(exists=True)  # a typo must not look like success
HARD_STOP_MARGIN = 5.0  # seconds after --grace before `watch` exits whatever it is doing


def _hard_stop(grace: float) -> None:
    click.echo(f"uploader: error: still uploading {grace + HARD_STOP_MARGIN:.0f} s after the stop signal "
               "(--grace plus a margin); exiting, the remote keeps its previous complete checkpoint", err=True)
    os._exit(EXIT_UNREACHABLE)


@main.command()
@click.argument("local", type=EXISTING_LOCAL)
@click.argument("remote_url", metavar="REMOTE")
@click.pass_obj
def sync(config: UploadConfig, local: Path, remote_url: str) -> None:
    """Upload every committed checkpoint in LOCAL that REMOTE lacks, then apply retention."""
    remote = _open(remote_url, config)
    if not list_committed(local):
        logger.warning("%s holds no committed checkpoint (a step-* folder with its manifest); nothing to upload", local)
    pushed = push_all(local, remote, config.keep)
    logger.info("sync done: %d checkpoint(s) uploaded%s", len(pushed), f" {pushed}" if pushed else "")


@main.command()
@click.argument("local", type=LOCAL)
@click.argument("remote_url", metavar="REMOTE")
@option("--poll-interval", type=Seconds(min=0, min_open=True), default=2.0,
        help="Seconds between looks at LOCAL.")
@option("--grace", type=Seconds(min=0), default=90.0,
        help="After SIGTERM, seconds left to finish uploading (keep below the pod's terminationGracePeriodSeconds).")
@click.pass_obj
def watch(config: UploadConfig, local: Path, remote_url: str, poll_interval: float, grace: float) -> None:
    """Sidecar: upload each newly committed checkpoint of LOCAL, newest first.

    Exits 0 by itself once the job has marked LOCAL finished and its last checkpoint is uploaded.
    After SIGTERM/SIGINT it keeps going until the job has ended (its final checkpoint committed and
    uploaded) or --grace runs out, then exits 0 (5 if an upload was still in flight).
    """
    remote = _open(remote_url, config)
    stop = threading.Event()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        # No logging here: the loop logs it (a signal handler must not take the logging lock).
        if not stop.is_set():
            stop.set()
            # watch() stops retrying when the grace period ends, but a request in flight runs on
            # until it ends or times out; this is the hard bound the pod's termination budget needs.
            deadline = threading.Timer(grace + HARD_STOP_MARGIN, _hard_stop, args=(grace,))
            deadline.daemon = True
            deadline.start()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    outcome = watch_loop(local, remote, config, stop, poll_interval=poll_interval, grace=grace)
    logger.info("watch ended: %s", outcome.value)


@main.command()
@click.argument("remote_url", metavar="REMOTE")
@click.argument("local", type=LOCAL)
@click.pass_obj
def pull(config: UploadConfig, remote_url: str, local: Path) -> None:
    """Download the newest complete, verified checkpoint of REMOTE into LOCAL; print its folder."""
    blocker = nearest_existing(local)
    if not blocker.is_dir():  # checked before any download, and without creating anything
        raise click.BadParameter(f"{local} cannot be created: {blocker} is a file", param_hint="LOCAL")
    remote = _open(remote_url, config)
    ckpt = pull_newest(remote, local)
    if ckpt is None:
        raise NoCheckpointFound(
            f"no complete checkpoint that verifies under {remote.url} ({remote.describe()}); "
            "start from scratch or check the remote URL"
        )
    click.echo(str(ckpt.path))


@main.command(name="ls")
@click.argument("remote_url", metavar="REMOTE")
@click.pass_obj
def ls(config: UploadConfig, remote_url: str) -> None:
    """List REMOTE's checkpoints: step, size, time, complete or not (and, on stderr, the ones set aside)."""
    remote = _open(remote_url, config)
    print_checkpoints(list_remote(remote))
    for name in list_set_aside(remote):
        logger.warning("%s/%s/ was set aside after failing verification (kept for inspection, never used)",
                       remote.url, name)


if __name__ == "__main__":
    main()
