"""torchrun, exiting with its workers' exit code (``job launch``).

torchrun exits 1 whenever a worker fails, whatever the worker's own code, and 1 with a traceback when
it is stopped by a signal itself. The codes the job documents (README, "Exit codes") are what
Kubernetes' podFailurePolicy and JobSet's failurePolicy match: 75 restarts for free, 2, 3, 4, 6 and 8
fail the run at once. Under plain torchrun neither rule ever fires, so a run stopped by a spot notice
counts against ``maxRestarts`` and a misconfigured one is restarted until that runs out.

``job launch`` takes torchrun's own arguments and runs torchrun's own ``main`` in this process: the
rendezvous, the agent, restarts and log handling are torchrun's, unchanged. Only its way out differs:

* a worker failed: the exit code of the first worker that failed (torchrun's root cause, the one its
  summary names). torchrun stops the others at the first failure, so they are not counted; where the
  ranks agree on why they stop (job.distributed.raise_together) every rank exits with the same code.
  A worker killed by signal N is 128 + N, as a shell reports it;
* torchrun itself got SIGTERM or SIGINT: it forwards the signal to the workers, which write their final
  checkpoint and exit 75, and waits for them (30 s, then SIGKILL). 75 then, as ``job train`` exits on
  the same signal: stopped, to be resumed. Any other signal torchrun handles: 128 + N.

One case it cannot tell apart: a signal that reaches the launcher while torchrun is stopping the other
workers after one failed (they may take their final checkpoint's time to exit) is 75 too, whatever that
worker's code was. torchrun keeps the failure it is handling to itself until the others are gone, and the
signal ends that wait with its own exception. A misconfigured run then restarts once more, for free, and
fails again with its code.
"""
from __future__ import annotations

import signal
from collections.abc import Sequence

import click
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from job.exceptions import EXIT_BUG, EXIT_PREEMPTED
from job.signals import HANDLED

SIGNALLED = 128  # a process killed by signal N exits 128 + N, in a shell's words


def launch(args: Sequence[str]) -> int:
    """torchrun with ``args``; the exit code its workers would have given (module docstring)."""
    try:
        torchrun.main(list(args))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = by_signal(-failure.exitcode) if failure.exitcode < 0 else failure.exitcode
        click.echo(f"job launch: rank {rank} exited {failure.exitcode}, the first of {len(e.failures)} "
                   f"failed worker(s); exiting {code}", err=True)
        return code or EXIT_BUG
    except SignalException as e:
        code = EXIT_PREEMPTED if e.sigval in HANDLED else by_signal(e.sigval)
        click.echo(f"job launch: stopped by {signal.Signals(e.sigval).name}; its workers were told too; "
                   f"exiting {code}", err=True)
        return code
    return 0


def by_signal(signum: int) -> int:
    return SIGNALLED + signum
