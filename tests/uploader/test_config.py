"""UploadConfig validation and remote URLs: mistakes are refused up front with a clear message."""
from __future__ import annotations

import pytest

from uploader.config import MAX_PARTS, MiB, UploadConfig
from uploader.filesystem import FileRemote
from uploader.remote import check_url, open_remote
from uploader.s3 import S3Remote, make_client, part_size_for


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("endpoint_url", "127.0.0.1:9000", "http(s) URL"),
        ("addressing", "sideways", "addressing must be one of"),
        ("max_attempts", 0, "max_attempts must be >= 1"),
        ("max_retry_seconds", 0, "max_retry_seconds must be > 0"),
        ("read_timeout", -1, "read_timeout must be > 0"),
        ("part_size", 4 * MiB, "5 MiB, the S3 minimum"),
        ("multipart_threshold", MiB, "multipart_threshold must be >="),
        ("concurrency", 0, "concurrency must be between 1 and 64"),
        ("keep", 0, "keep must be >= 1"),
    ],
)
def test_invalid_settings_are_refused(field: str, value: object, says: str) -> None:
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        UploadConfig(**{field: value})  # type: ignore[arg-type]


def test_defaults_are_valid_and_frozen() -> None:
    config = UploadConfig()
    with pytest.raises(AttributeError):
        config.keep = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("url", "kind", "where"),
    [
        ("s3://bucket/some/prefix/", S3Remote, "s3://bucket/some/prefix"),
        ("s3://bucket", S3Remote, "s3://bucket"),
        ("file:///mnt/shared/ckpt", FileRemote, "file:///mnt/shared/ckpt"),
    ],
)
def test_open_remote_parses_supported_urls(url: str, kind: type, where: str) -> None:
    remote = open_remote(url, UploadConfig(endpoint_url="http://127.0.0.1:1"))
    assert isinstance(remote, kind) and remote.url == where


@pytest.mark.parametrize("url", ["gs://bucket/x", "/just/a/path", "file://relative/x", "s3:///no-bucket"])
def test_open_remote_refuses_other_urls(url: str) -> None:
    with pytest.raises(ValueError, match="s3://bucket|file:///"):
        open_remote(url, UploadConfig())
    with pytest.raises(ValueError, match="s3://bucket|file:///"):
        check_url(url)  # what the job checks its --remote with, before opening anything


@pytest.mark.parametrize(("size", "expected"), [(10 * MiB, 16 * MiB), (16 * MiB * MAX_PARTS, 16 * MiB),
                                                (16 * MiB * MAX_PARTS + 1, 17 * MiB)])
def test_part_size_grows_only_past_the_part_count_limit(size: int, expected: int) -> None:
    assert part_size_for(size, 16 * MiB) == expected


@pytest.mark.parametrize(("endpoint", "signed"), [("https://s3.example.test", False), ("http://127.0.0.1:9", True)])
def test_bodies_are_sha256_signed_only_where_tls_does_not_protect_them(
        endpoint: str, signed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the client puts on the wire, caught before it is sent (nothing listens at these endpoints)."""
    import hashlib

    for name, value in {"AWS_ACCESS_KEY_ID": "AKIDTEST", "AWS_SECRET_ACCESS_KEY": "secret",
                        "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"}.items():
        monkeypatch.setenv(name, value)
    client = make_client(UploadConfig(endpoint_url=endpoint, region="us-east-1", addressing="path"))
    sent: list[str] = []

    class Caught(Exception):
        pass

    def capture(request, **_: object) -> None:
        sent.append(request.headers["X-Amz-Content-SHA256"].decode())
        raise Caught

    client.meta.events.register("before-send.s3.UploadPart", capture)
    body = b"part of a checkpoint" * 1000
    with pytest.raises(Caught):
        client.upload_part(Bucket="b", Key="k", UploadId="u", PartNumber=1, Body=body)
    assert sent == [hashlib.sha256(body).hexdigest() if signed else "UNSIGNED-PAYLOAD"]
