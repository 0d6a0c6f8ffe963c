"""Secrets (issue 16): an endpoint written as http://user:secret@host never shows its userinfo, nor
any URL its query string, in a log line or an error message."""
from __future__ import annotations

import io
import logging
import socket

import pytest
from botocore.exceptions import EndpointConnectionError

from tests.support.s3server import ADMIN, LOOPBACK, isolated_aws_env
from tests.support.uploader_cli import run_cli
from uploader.config import UploadConfig
from uploader.console import TerminalHandler
from uploader.redact import redact_text, redact_url
from uploader.remote import check_url
from uploader.retry import describe
from uploader.s3 import S3Remote


@pytest.mark.parametrize(
    ("url", "redacted"),
    [
        ("http://127.0.0.1:9000", "http://127.0.0.1:9000"),
        ("https://minio.example:9000/base/", "https://minio.example:9000/base/"),
        ("http://user:secret@127.0.0.1:9000", "http://***@127.0.0.1:9000"),
        ("http://user:p@ss@host/path", "http://***@host/path"),  # a raw "@" in the password
        ("http://token@host", "http://***@host"),
        ("http://user:ab/cd@host:9000", "http://***@host:9000"),  # a "/" in the password (AWS secret keys)
        ("http://user:ab?cd#ef@host", "http://***@host"),
        ("https://host/bucket/key?X-Amz-Signature=abc&X-Amz-Credential=k", "https://host/bucket/key?***"),
        ("s3://bucket/a@b", "s3://bucket/a@b"),  # an "@" in the path is no userinfo
        ("user:secret@127.0.0.1:9000", "***@127.0.0.1:9000"),  # no scheme: a typo the config refuses
        ("not a url", "not a url"),
    ],
)
def test_redact_url(url: str, redacted: str) -> None:
    assert redact_url(url) == redacted


def test_redact_text_finds_every_url_in_free_text() -> None:
    text = ('Could not connect to the endpoint URL: "http://user:secret@127.0.0.1:1/bucket?list-type=2&prefix=x" '
            "(then `https://a:b@other/x?sig=1`, s3://bucket/key and http://plain:80/ok)")

    assert redact_text(text) == (
        'Could not connect to the endpoint URL: "http://***@127.0.0.1:1/bucket?***" '
        "(then `https://***@other/x?***`, s3://bucket/key and http://plain:80/ok)"
    )


def test_messages_about_an_endpoint_with_credentials_never_show_them() -> None:
    endpoint = f"http://user:secret@{LOOPBACK}:1"
    remote = S3Remote.from_url("s3://bucket/x", UploadConfig(endpoint_url=endpoint))

    with pytest.raises(ValueError) as refused:
        UploadConfig(endpoint_url="ftp://user:secret@host:21")

    assert remote.describe() == f"bucket 'bucket' at http://***@{LOOPBACK}:1"
    assert "secret" not in describe(EndpointConnectionError(endpoint_url=f"{endpoint}/bucket?list-type=2"))
    assert "secret" not in str(refused.value) and "ftp://***@host:21" in str(refused.value)
    remote.close()


@pytest.mark.parametrize("url", ["s3://user:secret@bucket/x", "ftp://user:secret@host/x", "file://user:secret@host/x"])
def test_a_remote_url_with_credentials_is_refused_without_showing_them(url: str) -> None:
    with pytest.raises(ValueError) as refused:
        check_url(url)
    assert "secret" not in str(refused.value) and "://***@" in str(refused.value)


def test_a_traceback_logged_on_a_terminal_is_redacted() -> None:
    """``--log-level debug`` logs the error's traceback (text handler; the JSON one logs no traceback)."""
    stream = io.StringIO()
    logger = logging.getLogger("test_redact.terminal")
    logger.propagate = False
    logger.addHandler(TerminalHandler(stream))
    try:
        try:
            raise ConnectionError("cannot reach http://user:secret@host:1/bucket?X-Amz-Signature=s")
        except ConnectionError:
            logger.error("failed talking to http://user:secret@host:1", exc_info=True)
    finally:
        logger.handlers.clear()

    assert "Traceback" in stream.getvalue() and "http://***@host:1/bucket?***" in stream.getvalue()
    assert "secret" not in stream.getvalue() and "X-Amz-Signature" not in stream.getvalue()


@pytest.mark.parametrize("log_level", ["info", "debug"])
def test_the_cli_never_prints_an_endpoints_credentials(log_level: str) -> None:
    with socket.socket() as unused:
        unused.bind((LOOPBACK, 0))  # bound, never listening: every connection is refused at once
        endpoint = f"http://user:secret@{LOOPBACK}:{unused.getsockname()[1]}"

        result = run_cli(["--endpoint-url", endpoint, "--max-retry-seconds", "1", "--log-level", log_level,
                          "ls", "s3://bucket/x"], isolated_aws_env(ADMIN))

    assert result.returncode == 5, result.stderr
    assert "retry 1 of at most" in result.stderr  # the retry log lines name the URL, redacted
    assert f"http://***@{LOOPBACK}" in result.stderr.strip().splitlines()[-1]
    assert "secret" not in result.stderr and "secret" not in result.stdout
