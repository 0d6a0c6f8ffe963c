"""Resuming a sharded checkpoint on 1, 2 and 4 simulated nodes, each behind its own link to the bucket.

Issue 18: each node downloads only the files its ranks read (job.node_pull), all nodes at once, so the
time from start to the first step with N nodes should be about the time to pull 1/N of the checkpoint.

Setup: one sharded checkpoint written by 4 ranks (``torchrun --nproc-per-node 4 job train --sharded``,
AdamW) in a SeaweedFS bucket. A simulated node is a ``torchrun --nnodes N --node-rank i
--nproc-per-node 1`` launcher on loopback with its own --save-folder and its own link to the bucket:
a TCP proxy paced to ``--link-mbps`` each way (bench.link; a NIC). Without the links every node would
share this machine's loopback and cores, and N nodes could not pull faster than one.

Arms, per round, every one from fresh folders:

* ``single``: one pull of the whole checkpoint through one link (uploader.sync.pull_newest, in this
  process): the reference. Its 1/N is what N nodes should take.
* ``fresh N``: N nodes starting a new run (nothing in their prefix), from spawning the launchers to
  the ``start`` event on node 0 (training begins): process start-up, rendezvous, building the model.
* ``resume N``: N nodes resuming the checkpoint (``--upload off``), timed the same way; each node's
  ``pulled`` event gives its bytes. ``resume N - fresh N`` is what the resume adds.

One node runs two ranks (``--sharded`` needs two), and takes the one-node path: the whole checkpoint,
pulled while the model is built. More nodes run one rank each.
The last line gives, for each N, the time to the first step and what the resume adds, against 1/N of
the single pull.
"""
from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/node_pull.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import human_bytes, median, parser, print_machine, progress, s3_bucket, scratch
from bench.link import Link
from bench.models import FOREVER, SIZES, model_spec

WRITERS = 4  # ranks that write the checkpoint
NODES = (1, 2, 4)
BATCH = 16  # per writing rank: a global batch of 64 that 1, 2 and 4 ranks share


def launch(nodes: int, folders: list[Path], remote: str, envs: list[dict[str, str]], model: str,
           extra: list[str]) -> list[Any]:
    from tests.job.test_multinode import free_port
    from tests.support.jobs import JobProcess

    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    per_node = 2 if nodes == 1 else 1  # --sharded needs two ranks
    return [JobProcess([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node-rank", str(i),
                        "--nproc-per-node", str(per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                        "--rdzv-id", run_id, "-m", "job", "train", "--sharded", "--model", model,
                        "--batch-size", str(BATCH * WRITERS // (nodes * per_node)), "--eval-interval", FOREVER,
                        "--save-interval", FOREVER, "--log-format", "json", "--remote", remote,
                        "--save-folder", str(folders[i]), *extra], env=envs[i])
            for i in range(nodes)]


def to_first_step(procs: list[Any], started: float) -> tuple[float, list[dict[str, Any]]]:
    """Seconds from ``started`` (time.time) to node 0's ``start`` event; then stop every node. The
    ``pulled`` events of every node."""
    from tests.support.jobs import events

    try:
        began = procs[0].wait_event("start", timeout=900)
    except AssertionError:
        raise SystemExit("a node did not start training:\n" + "\n".join(
            p.stderr[-2000:] for p in procs))
    finally:
        for proc in procs:
            proc.kill()
    return began["ts"] - started, [e for p in procs for e in events(p.stderr) if e.get("event") == "pulled"]


def seed(bucket: Any, workdir: Path, model: str, env: dict[str, str]) -> tuple[int, int]:
    """The checkpoint every resume arm reads: one step on WRITERS ranks, uploaded. Its step and size."""
    import subprocess

    from uploader.remote import open_remote
    from uploader.sync import newest_complete
    from tests.support.s3server import fast_config

    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WRITERS), "-m", "job",
         "train", "--sharded", "--model", model, "--batch-size", str(BATCH), "--max-duration", "1ba",
         "--eval-interval", FOREVER, "--save-interval", FOREVER, "--remote", bucket.url("run"),
         "--save-folder", str(workdir / "seed"), "--resume", "never"],
        env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"seeding the checkpoint failed:\n{done.stderr[-3000:]}")
    remote = open_remote(bucket.url("run"), fast_config(bucket.endpoint_url))
    try:
        found = newest_complete(remote)
    finally:
        remote.close()
    assert found is not None
    return found[0], found[1].total_size


def single_pull(bucket: Any, link: Link, folder: Path) -> float:
    from tests.support.s3server import fast_config
    from uploader.remote import open_remote
    from uploader.sync import pull_newest

    remote = open_remote(bucket.url("run"), fast_config(link.endpoint_url))
    try:
        started = time.perf_counter()
        pulled = pull_newest(remote, folder)
        seconds = time.perf_counter() - started
    finally:
        remote.close()
    assert pulled is not None
    return seconds


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--model", default="400MB", help=f"a size ({', '.join(SIZES)}) or a --model spec")
    p.add_argument("--link-mbps", type=float, default=160.0, help="each node's link to the bucket, megabits/s")
    args = p.parse_args(argv)
    if args.smoke:
        args.model = "smoke"
    rounds = args.rounds or 1
    model, rate = model_spec(args.model), args.link_mbps * 1e6 / 8
    from tests.support.jobs import s3_job_env

    print_machine(args.tmpdir)
    with scratch("node-pull", args.tmpdir) as workdir, s3_bucket(workdir) as bucket:
        upstream = int(bucket.endpoint_url.rsplit(":", 1)[1])
        links = [Link(upstream, rate) for _ in range(max(NODES))]
        envs = [{**s3_job_env(bucket), "JOB_ENDPOINT_URL": link.endpoint_url} for link in links]
        step, size = seed(bucket, workdir, model, s3_job_env(bucket))
        progress(f"model {model}: a sharded checkpoint of {human_bytes(size)} at step {step}, written by {WRITERS} "
                 f"ranks; each node's link {args.link_mbps:g} Mbit/s ({human_bytes(rate)}/s)")
        counter = iter(range(10 ** 6))
        singles: list[float] = []
        fresh: dict[int, list[float]] = {n: [] for n in NODES}
        resumed: dict[int, list[float]] = {n: [] for n in NODES}
        pulled: dict[int, list[dict[str, Any]]] = {}
        for r in range(rounds):
            singles.append(single_pull(bucket, links[0], workdir / f"single-{next(counter)}"))
            progress(f"round {r + 1}: single pull {singles[-1]:.2f} s")
            for n in NODES:
                for arm, remote, extra, into in (
                        ("fresh", bucket.url(f"fresh-{next(counter)}"), ["--max-duration", "1ba"], fresh),
                        ("resume", bucket.url("run"), ["--max-duration", f"{step + 1}ba", "--upload", "off"], resumed)):
                    folders = [workdir / f"{arm}-{next(counter)}-node{i}" for i in range(n)]
                    started = time.time()
                    seconds, pulls = to_first_step(launch(n, folders, remote, envs, model, extra), started)
                    into[n].append(seconds)
                    if arm == "resume":
                        pulled[n] = pulls
                    progress(f"round {r + 1}: {arm} on {n} node(s): first step after {seconds:.2f} s"
                             + "".join(f"; node {e['node']} pulled {human_bytes(e['bytes'])} in {e['seconds']:.2f} s"
                                       for e in sorted(pulls, key=lambda e: e["node"])))
        for link in links:
            link.close()

    single = median(singles)
    print(f"single pull of the whole {human_bytes(size)} through one link: {single:.2f} s")
    print(f"{'nodes':>5} {'fresh start':>12} {'resume':>8} {'resume adds':>12} {'1/N of single':>14} "
          f"{'largest node pull':>18}")
    line = []
    for n in NODES:
        start, res = median(fresh[n]), median(resumed[n])
        largest = max((e["bytes"] for e in pulled.get(n, [])), default=size)
        print(f"{n:>5} {start:>11.2f}s {res:>7.2f}s {res - start:>11.2f}s {single / n:>13.2f}s "
              f"{human_bytes(largest):>18}")
        line.append(f"{n} node(s) {res / (single / n):.2f}x ({(res - start) / (single / n):.2f}x without start-up)")
    print("ratio, first step / (1/N of a single pull): " + ", ".join(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
