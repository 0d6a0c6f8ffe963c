"""What the upload's transit checksum costs: CRC32C (shipped) against CRC32 (before) and s3torchconnector.

A diagnostic for bench/transfer.py's upload ratio against s3torchconnector (BENCHMARKS.md, "Nineteenth
session"). Over plain HTTP every part of ours carries a checksum the server verifies (uploader.transit);
s3tc sends none. Two measurements:

* **One core, no I/O**: CPU seconds per GiB of each candidate over a buffer in memory, interleaved:
  ``crc32c`` (PyPI ``crc32c``, hardware CRC32C: what uploader.transit sends), ``zlib.crc32`` (the CRC32
  it sent before), ``sha256`` (what botocore's body signature would compute instead) and ``blake3`` (the
  manifest's digest, which the upload computes over what it reads either way).
* **The upload**, arms interleaved in balanced orders against one SeaweedFS, 1 GiB by default:
  ``ours`` as shipped; ``ours_crc32``, the same with uploader.transit switched to CRC32 (zlib) for the
  arm, the way it was before (diagnostic only: both are checked by the server, ``x-amz-checksum-crc32``
  and ``-crc32c``); ``s3tc``, bench.transfer's s3torchconnector arm. Wall, client CPU and server CPU per
  arm. Client and server share the machine's cores, so a CPU-second of checksum is taken from the server.
  Three arms take a full cycle of bench.common's balanced orders every 6 rounds (the default); the
  server's slow and fast phases move every arm's time, so ``--rounds 12`` for a recorded number.
"""
from __future__ import annotations

import hashlib
import os
import sys
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/upload_checksum.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import blake3
import crc32c

from bench.common import (GiB, MiB, add_settle_option, interleaved, median, parser, print_machine, progress,
                          ratio, s3_server, scratch, settle_seconds)
from bench.transfer import FILE, Clock, S3tcProcess
from tests.support.checkpoints import make_checkpoint

TARGET = 1.0  # issue 19: upload at least as fast as s3torchconnector
BUFFER = 256 * MiB
ONE_CORE: dict[str, Callable[[bytes], Any]] = {
    "crc32c": crc32c.crc32c,
    "zlib.crc32": zlib.crc32,
    "sha256": lambda b: hashlib.sha256(b).digest(),
    "blake3": lambda b: blake3.blake3(b).digest(),  # one thread, as uploader.hashing uses it
}


def one_core(rounds: int) -> dict[str, float]:
    """CPU seconds per GiB of each function of ONE_CORE, median of ``rounds``."""
    data = os.urandom(BUFFER)

    def arm(fn: Callable[[bytes], Any]) -> Callable[[], float]:
        def run() -> float:
            with Clock(children=False) as clock:
                fn(data)
            return clock.result()["cpu"] * GiB / BUFFER
        return run

    results = interleaved({name: arm(fn) for name, fn in ONE_CORE.items()}, rounds=rounds, warmup=1)
    return {name: median(values) for name, values in results.items()}


@contextmanager
def transit_crc32() -> Iterator[None]:
    """uploader.transit as it was before CRC32C: zlib's CRC32 in x-amz-checksum-crc32."""
    import base64

    import uploader.transit as transit

    saved = transit.ALGORITHM, transit.HEADER, transit.crc32c_base64
    transit.ALGORITHM, transit.HEADER = "CRC32", "x-amz-checksum-crc32"
    transit.crc32c_base64 = lambda body: base64.b64encode(zlib.crc32(body).to_bytes(4, "big")).decode("ascii")
    try:
        yield
    finally:
        transit.ALGORITHM, transit.HEADER, transit.crc32c_base64 = saved


def main(argv: list[str] | None = None) -> int:
    from uploader.config import UploadConfig
    from uploader.remote import open_remote
    from uploader.sync import push

    p = parser(__doc__)
    p.add_argument("--size-mib", type=int, default=1024, help="checkpoint size in MiB")
    add_settle_option(p)
    args = p.parse_args(argv)
    size = (16 if args.smoke else args.size_mib) * MiB
    rounds = args.rounds or (1 if args.smoke else 6)  # three arms: a full cycle of balanced orders
    print_machine(args.tmpdir)

    cpu = one_core(rounds=max(rounds, 3))
    print("one core, CPU seconds per GiB, median: "
          + ", ".join(f"{name} {seconds:.3f}" for name, seconds in cpu.items())
          + f"; zlib.crc32 / crc32c = {cpu['zlib.crc32'] / cpu['crc32c']:.1f}x", flush=True)

    with scratch("upload_checksum", args.tmpdir) as workdir, s3_server(workdir) as (bucket, server_cpu):
        config = UploadConfig(endpoint_url=bucket.endpoint_url, addressing="path")
        ckpt = make_checkpoint(workdir / "local", step=1, files={FILE: size})
        tc = S3tcProcess(bucket.endpoint_url, "us-east-1", dict(os.environ))
        counter = iter(range(10 ** 6))
        remotes = {name: open_remote(bucket.url(name), config) for name in ("ours", "ours_crc32")}

        def ours(name: str) -> Callable[[], dict[str, float]]:
            def run() -> dict[str, float]:
                remote = remotes[name]
                with transit_crc32() if name == "ours_crc32" else nullcontext():
                    with Clock(children=False, server=server_cpu) as clock:
                        push(ckpt, remote, keep=1)
                    if not remote._transit.checksums:  # noqa: SLF001 - the diagnostic checks its own premise
                        raise RuntimeError(f"{name}: the server stopped verifying the checksum; not comparable")
                remote.delete([o.key for o in remote.list()])
                return clock.result()
            return run

        def s3tc() -> dict[str, float]:
            before = server_cpu()
            _, clock = tc.call("upload", ckpt.path / FILE, f"s3://{bucket.name}/tc-{next(counter)}/{FILE}")
            return {**clock, "server": server_cpu() - before}

        arms = {"ours": ours("ours"), "ours_crc32": ours("ours_crc32"), "s3tc": s3tc}
        results = interleaved(arms, rounds=rounds, log=progress, settle=settle_seconds(args))
        for remote in remotes.values():
            remote.close()
        tc.close()

    gib = size / GiB
    m = {name: {key: median([r[key] for r in runs]) for key in ("wall", "cpu", "server")}
         for name, runs in results.items()}
    for name, values in m.items():
        print(f"{name:10s} wall {values['wall']:6.2f} s, client CPU {values['cpu'] / gib:5.2f} s/GiB, "
              f"server CPU {values['server'] / gib:6.2f} s/GiB (medians of {rounds}); walls "
              + " ".join(f"{r['wall']:.1f}" for r in results[name]))
    if tc.failures:
        print(f"s3torchconnector failures (made again): {tc.failures}")
    print(f"client CPU per GiB, ours_crc32 - ours: {(m['ours_crc32']['cpu'] - m['ours']['cpu']) / gib:+.2f} s; "
          f"ours - s3tc: {(m['ours']['cpu'] - m['s3tc']['cpu']) / gib:+.2f} s")
    print(ratio("upload ours/s3tc", m["s3tc"]["wall"] / m["ours"]["wall"], TARGET, at_most=False)
          + f"; ours_crc32/s3tc = {m['s3tc']['wall'] / m['ours_crc32']['wall']:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
