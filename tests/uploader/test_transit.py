"""Over plain HTTP the checkpoint's data carries a CRC32C that the real server checks (uploader.transit)."""
from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from tests.support.checkpoints import WITH_LARGE_FILE, data_files_of, make_checkpoint
from tests.support.faultproxy import FaultProxy
from tests.support.s3server import Bucket, fast_config
from uploader.config import MiB
from uploader.remote import Remote, open_remote
from uploader.sync import pull_newest, push
from uploader.transit import HEADER, crc32c_base64

pytestmark = pytest.mark.s3

SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def via(proxy: FaultProxy, bucket: Bucket) -> Remote:
    return open_remote(bucket.url(), fast_config(proxy.endpoint_url))


def parts(proxy: FaultProxy) -> list[dict[str, str]]:
    """The headers of every UploadPart request that went through ``proxy``, in order."""
    return [headers for line, headers in proxy.counters.request_heads
            if line.startswith("PUT ") and "partNumber=" in line]


def test_data_goes_unsigned_with_a_crc32c_and_small_bodies_stay_signed(
        fault_proxy: FaultProxy, s3_bucket: Bucket, tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "local", 10, WITH_LARGE_FILE)
    remote = via(fault_proxy, s3_bucket)

    push(ckpt, remote, keep=3)

    sent = parts(fault_proxy)
    assert len(sent) >= 2
    assert HEADER == "x-amz-checksum-crc32c"
    assert all(h["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD" and h.get(HEADER) for h in sent)
    manifest = [h for line, h in fault_proxy.counters.request_heads
                if line.startswith("PUT ") and "manifest.json" in line]
    assert manifest and all(SHA256_HEX.fullmatch(h["x-amz-content-sha256"]) for h in manifest)
    pulled = pull_newest(remote, tmp_path / "restore")
    assert pulled is not None and data_files_of(pulled.path) == data_files_of(ckpt.path)


def test_a_part_damaged_on_the_way_is_refused_by_the_server_and_sent_again(
        fault_proxy: FaultProxy, s3_bucket: Bucket, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ckpt = make_checkpoint(tmp_path / "local", 10, WITH_LARGE_FILE)
    remote = via(fault_proxy, s3_bucket)
    fault_proxy.corrupt(1, min_length=MiB)  # one part's first byte, after the client computed its CRC32C

    with caplog.at_level(logging.WARNING, logger="uploader.retry"):
        push(ckpt, remote, keep=3)

    assert fault_proxy.counters.corrupted == 1
    assert "BadDigest" in caplog.text
    numbers = [line.split("partNumber=")[1].split("&")[0] for line, _ in fault_proxy.counters.request_heads
               if "partNumber=" in line]
    assert len(numbers) == len(set(numbers)) + 1  # exactly one part went twice
    pulled = pull_newest(remote, tmp_path / "restore")
    assert pulled is not None and data_files_of(pulled.path) == data_files_of(ckpt.path)


def test_a_server_that_ignores_the_checksum_gets_signed_bodies_instead(
        fault_proxy: FaultProxy, s3_bucket: Bucket, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Its replies do not echo x-amz-checksum-crc32c: the unverified body is sent again signed, and so is
    everything after it; one warning."""
    fault_proxy.strip_response_header(HEADER)
    ckpt = make_checkpoint(tmp_path / "local", 10, WITH_LARGE_FILE)
    remote = via(fault_proxy, s3_bucket)

    with caplog.at_level(logging.WARNING, logger="uploader.transit"):
        push(ckpt, remote, keep=3)
        push(make_checkpoint(tmp_path / "local", 20, WITH_LARGE_FILE), remote, keep=3)

    assert caplog.text.count(f"does not verify {HEADER}") == 1
    puts = [h for line, h in fault_proxy.counters.request_heads if line.startswith("PUT ")]
    unsigned = [h for h in puts if h["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD"]
    assert 1 <= len(unsigned) <= fast_config().concurrency  # at most the first window, before the switch
    assert all(SHA256_HEX.fullmatch(h["x-amz-content-sha256"]) for h in parts(fault_proxy)[-3:])
    pulled = pull_newest(remote, tmp_path / "restore")
    assert pulled is not None and pulled.step == 20


def test_a_server_that_refuses_the_checksum_gets_signed_bodies_instead(
        fault_proxy: FaultProxy, s3_bucket: Bucket, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """501 NotImplemented for any x-amz-checksum-* header (the multipart upload's announcement first):
    the request is made again without it, signed; one warning; the checkpoint is whole."""
    fault_proxy.refuse_header("x-amz-checksum-")
    ckpt = make_checkpoint(tmp_path / "local", 10, WITH_LARGE_FILE)
    remote = via(fault_proxy, s3_bucket)

    with caplog.at_level(logging.WARNING, logger="uploader.transit"):
        push(ckpt, remote, keep=3)

    assert fault_proxy.counters.refused >= 1
    assert caplog.text.count(f"does not verify {HEADER}: it refused it (NotImplemented)") == 1
    assert all(SHA256_HEX.fullmatch(h["x-amz-content-sha256"]) for h in parts(fault_proxy))
    pulled = pull_newest(remote, tmp_path / "restore")
    assert pulled is not None and data_files_of(pulled.path) == data_files_of(ckpt.path)


def test_crc32c_is_s3s_encoding() -> None:
    """Big-endian, base64, as S3 documents x-amz-checksum-crc32c: the standard check value of CRC-32C
    (Castagnoli), not CRC-32's 0xCBF43926, whatever the body's buffer type."""
    assert crc32c_base64(b"123456789") == "4waSgw=="  # 0xE3069283
    assert crc32c_base64(memoryview(bytearray(b"123456789"))) == "4waSgw=="
    assert crc32c_base64(b"") == "AAAAAA=="
