"""Errors the job reports at the CLI edge, each with its documented exit code.

Exit codes (README, "Exit codes"; also used by k8s podFailurePolicy):
  0   finished
  1   unexpected error (a bug: the traceback is printed)
  2   bad flags or configuration
  3   storage refused access (403, InvalidAccessKeyId, SignatureDoesNotMatch; a file:// folder this user may not write)
  4   the bucket does not exist
  5   storage unreachable after retries
  6   a checkpoint cannot be used (corrupt, hostile, incompatible, or --resume PATH is not one)
  7   a checkpoint cannot be written (disk full, permissions), or one pulled cannot be written locally;
      the previous one is untouched
  8   training diverged: the state to checkpoint holds NaN or Inf (or its float16 loss scale is 0); it is not
      written, the ones before it are kept
  75  stopped to be resumed (preempted: SIGTERM/SIGINT after a final checkpoint)
"""
from __future__ import annotations

EXIT_OK = 0
EXIT_BUG = 1
EXIT_USAGE = 2
EXIT_AUTH = 3
EXIT_NO_BUCKET = 4
EXIT_UNREACHABLE = 5
EXIT_BAD_CHECKPOINT = 6
EXIT_WRITE_FAILED = 7
EXIT_DIVERGED = 8
EXIT_PREEMPTED = 75


# What to do about a checkpoint that verifies byte for byte but whose content is damaged or hostile: the end
# of every message that refuses one (job.safe_load, job.restore, job.elastic).
ADVICE = "restore a good checkpoint, or start a new run in another --save-folder/--remote"


class JobError(Exception):
    """An error with a one-line message for the user and an exit code."""

    exit_code = EXIT_BUG


class ConfigError(JobError):
    exit_code = EXIT_USAGE


class CheckpointLoadError(JobError):
    exit_code = EXIT_BAD_CHECKPOINT


class CheckpointWriteError(JobError):
    exit_code = EXIT_WRITE_FAILED


class Diverged(JobError):
    """The state a checkpoint would hold has NaN or Inf in its parameters or optimizer state, or a loss scale
    that backed off to 0 (state.finite): it is not written, so retention never pushes a good checkpoint out
    for it. A new pod would resume the last good one and, with the same flags, diverge at the same step: exit
    8 fails the Kubernetes Job."""

    exit_code = EXIT_DIVERGED


class StoppedBeforeTraining(JobError):
    """A stop request (SIGTERM, SIGINT) before the first step, while the start-up waited for a download: nothing
    was trained, so nothing is saved; the checkpoint being pulled stays in the bucket (job.storage.Pull)."""

    exit_code = EXIT_PREEMPTED


class OtherRankError(JobError):
    """What another rank failed with, raised here with that rank's exit code, so that every rank of a
    collective step ends the same way (a full disk on one node is not a corrupt checkpoint on the rest)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class BadRecord(ValueError):
    """A ledger record (job.ledger) that is malformed or out of range. Never fatal and never a JobError:
    ``job report`` skips the record and names the reason (job.goodput)."""


def exit_code_for(error: BaseException) -> int:
    """The documented exit code the CLI gives ``error`` (job.cli.run), for records kept before it exits."""
    from state import PrecisionError
    from uploader.cli import exit_code as storage_exit_code
    from uploader.exceptions import UploaderError

    if isinstance(error, JobError):
        return error.exit_code
    if isinstance(error, UploaderError):
        return storage_exit_code(error)
    if isinstance(error, PrecisionError):
        return EXIT_USAGE
    return EXIT_BUG
