"""Where the time of our download goes: ``S3Remote.get_file`` with its pieces switched off, vs. s5cmd.

A diagnostic for bench/transfer.py's download ratio (BENCHMARKS.md, "transfer"). Arms, interleaved,
all fetching the same object from the same SeaweedFS server with the same part size and window:

* ``get_file``: ours as shipped, on a format 2 file: ranged GETs ``--concurrency`` at a time, each
  streamed from the socket into its place in the file through a reused 1 MiB buffer and block-hashed
  by its own thread on the way, no fsync and no writeback hint (a pull's durable copy is the
  bucket's: uploader.sync, "Pull").
* ``get_file_1mib``: the same, each received 1 MiB chunk written to the page cache whole instead of
  in ``uploader.s3.WRITE_SLICE`` (32 KiB) pieces, as before the fifth session (BENCHMARKS.md).
* ``get_file_<N>k`` (one per ``--slice-kib N``): the same, written in N KiB pieces instead: how
  WRITE_SLICE's size was chosen.
* ``get_file_v1``: the same object as a format 1 entry (plain sha256): finished ranges are hashed in
  order from the page cache, on one thread.
* ``no_hash``: format 1's path without its sha256 pass (and without its check): receive and write only.
* ``net_only``: receive only, the bytes discarded: the network + server floor of our client.
* ``s5cmd`` and ``s5cmd+fsync``: the reference, and what waiting for the disk adds to it.

The pieces are switched off by replacing uploader.s3's helpers for the one arm (diagnostic only).
CPU seconds (user and sys of the client) are shown with the wall time: client and server share the
machine's cores, so every CPU-second the client spends is taken from the server too. "best" is the
fastest round: on this VM fresh page-cache pages cost a host fault each, which makes single rounds
vary by 2-3x (BENCHMARKS.md, "Fresh memory is expensive").
"""
from __future__ import annotations

import hashlib
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/download_breakdown.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from uploader.hashing import fsync_path, sha256_file
from bench.common import (MB, KiB, MiB, interleaved, median, parser, print_machine, progress,
                          s3_bucket, scratch, venv_binary)
from tests.support.checkpoints import make_checkpoint

FILE = "state.pt"


def cpu_seconds() -> tuple[float, float]:
    """(user, sys) of this process and its finished children (s5cmd)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + kids.ru_utime, own.ru_stime + kids.ru_stime


def clocked(fn: Any) -> dict[str, float]:
    wall, (user, sys_) = time.perf_counter(), cpu_seconds()
    fn()
    after = cpu_seconds()
    return {"wall": time.perf_counter() - wall, "user": after[0] - user, "sys": after[1] - sys_}


def main(argv: list[str] | None = None) -> int:
    from uploader import s3
    from uploader.config import UploadConfig
    from uploader.remote import open_remote
    from uploader.sync import push

    p = parser(__doc__)
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--part-size", type=int, default=16, help="MiB, for every arm of ours")
    p.add_argument("--concurrency", type=int, default=8, help="for every arm of ours")
    p.add_argument("--slice-kib", type=int, action="append", default=[],
                   help="add an arm get_file_<N>k writing in N KiB pieces (repeatable)")
    p.add_argument("--arms", default="all",
                   help="comma-separated arms to run (get_file, s5cmd and the --slice-kib arms always run)")
    args = p.parse_args(argv)
    if any(n <= 0 for n in args.slice_kib):
        p.error("--slice-kib takes a positive number of KiB")
    size = (16 if args.smoke else args.size_mib) * MiB
    rounds = args.rounds or (1 if args.smoke else 5)
    print_machine(args.tmpdir)
    with scratch("download", args.tmpdir) as workdir, s3_bucket(workdir) as bucket:
        config = UploadConfig(endpoint_url=bucket.endpoint_url, addressing="path", part_size=args.part_size * MiB,
                              concurrency=args.concurrency)
        ckpt = make_checkpoint(workdir / "local", step=1, files={FILE: size})
        entry = ckpt.manifest().files[0]
        plain_sha256 = sha256_file(ckpt.path / FILE)[1]  # the same file's format 1 digest
        remote = open_remote(bucket.url("seed"), config)
        push(ckpt, remote, keep=1)
        key = f"{ckpt.name}/{FILE}"
        out = workdir / "out.bin"
        s5 = [str(venv_binary("s5cmd")), "--endpoint-url", bucket.endpoint_url, "cp",
              f"s3://{bucket.name}/seed/{key}", str(out)]
        shipped = {"hash_range": s3.hash_range, "pwrite_all": s3.pwrite_all}
        shipped_slice = s3.WRITE_SLICE
        skip = lambda *_: None  # noqa: E731
        no_hash_sha = hashlib.sha256().hexdigest()

        def ours(*off: str, block_size: int | None = entry.block_size, write_slice: int = s3.WRITE_SLICE) -> Any:
            # Arms without hashing take format 1's path with its in-order hash skipped (format 2
            # hashes inside the stream, where it cannot be switched off separately).
            if "hash_range" in off:
                block_size, digest, algorithm = None, no_hash_sha, "sha256"
            elif block_size is not None:
                digest, algorithm = entry.digest, entry.algorithm
            else:
                digest, algorithm = plain_sha256, "sha256"
            def fetch() -> None:
                for name, fn in shipped.items():
                    setattr(s3, name, skip if name in off else fn)
                s3.WRITE_SLICE = write_slice
                try:
                    remote.get_file(key, out, size=size, digest=digest, algorithm=algorithm, block_size=block_size)
                finally:
                    for name, fn in shipped.items():
                        setattr(s3, name, fn)
                    s3.WRITE_SLICE = shipped_slice
            return fetch

        def s5cmd() -> None:
            subprocess.run(s5, check=True, capture_output=True)

        def s5cmd_fsync() -> None:
            s5cmd()
            fsync_path(out)

        def arm(fn: Any) -> Any:
            def measured() -> dict[str, float]:
                try:
                    return clocked(fn)
                finally:
                    out.unlink(missing_ok=True)
            return measured

        arms = {"get_file": ours(), "get_file_1mib": ours(write_slice=s3.STREAM_CHUNK),
                "get_file_v1": ours(block_size=None), "no_hash": ours("hash_range"),
                "net_only": ours("hash_range", "pwrite_all"),
                "s5cmd": s5cmd, "s5cmd+fsync": s5cmd_fsync}
        sliced = {f"get_file_{n}k": ours(write_slice=n * KiB) for n in args.slice_kib}
        arms.update(sliced)
        if args.arms != "all":
            wanted = {"get_file", "s5cmd", *sliced, *args.arms.split(",")}
            if unknown := wanted - arms.keys():
                p.error(f"unknown arm(s) {', '.join(sorted(unknown))}; the arms are {', '.join(arms)}")
            arms = {name: fn for name, fn in arms.items() if name in wanted}
        results = interleaved({name: arm(fn) for name, fn in arms.items()}, rounds=rounds, log=progress)
        remote.close()

    med = {name: {k: median([r[k] for r in runs]) for k in runs[0]} for name, runs in results.items()}
    best = {name: min(r["wall"] for r in runs) for name, runs in results.items()}
    print(f"{size / MiB:g} MiB, part {args.part_size} MiB x {args.concurrency}, median (best) of {rounds}:")
    for name, m in med.items():
        print(f"  {name:12s} {size / m['wall'] / MB:6.0f} MB/s ({m['wall']:.2f} s, best {best[name]:.2f} s), "
              f"client CPU user {m['user']:.2f} s + sys {m['sys']:.2f} s")
    print(f"ratio get_file/s5cmd = {med['s5cmd']['wall'] / med['get_file']['wall']:.3g} (median), "
          f"{best['s5cmd'] / best['get_file']:.3g} (best)"
          + (f"; vs s5cmd+fsync: {med['s5cmd+fsync']['wall'] / med['get_file']['wall']:.3g} (median)"
             if "s5cmd+fsync" in med else "")
          + " (throughput, >= 1 means ours is faster)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
