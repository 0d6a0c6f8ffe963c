"""The metadata clients against a local IMDSv2 / GCE stand-in."""
from __future__ import annotations

import time

import pytest

from job.spot import GCP_NOTICE_SECONDS, AwsImds, GceMetadata, SpotWatcher, make_source
from tests.support.metadata import MetadataServer


@pytest.fixture
def meta():
    with MetadataServer() as server:
        yield server


def test_aws_no_notice_is_a_404(meta):
    assert AwsImds(meta.url).poll() is None
    assert meta.tokens_issued == 1 and meta.rejected == 0


def test_aws_instance_action_and_rebalance(meta):
    imds = AwsImds(meta.url)
    meta.notice_rebalance()
    assert imds.poll().kind == "rebalance"
    meta.notice_aws(seconds_from_now=120, action="stop")
    notice = imds.poll()
    assert notice.kind == "stop" and notice.deadline == meta.aws_deadline()


def test_aws_token_is_refreshed_after_expiry(meta):
    imds = AwsImds(meta.url)
    imds.poll()
    meta.expire_tokens()
    meta.notice_aws(seconds_from_now=60)
    assert imds.poll().kind == "terminate"
    assert meta.tokens_issued == 2


def test_gce_requires_the_flavor_header_and_reports_preemption(meta):
    gce = GceMetadata(meta.url)
    assert gce.poll() is None
    meta.gce_preempted = True
    before = time.time()
    notice = gce.poll()
    after = time.time()
    assert notice.kind == "preempted" and before + GCP_NOTICE_SECONDS <= notice.deadline <= after + GCP_NOTICE_SECONDS
    assert meta.rejected == 0
    assert all(h.get("Metadata-Flavor") == "Google" for m, p, h in meta.requests if p.startswith("/computeMetadata"))


def test_auto_picks_the_server_that_answers(meta):
    assert make_source("auto", meta.url).provider == "aws"
    assert make_source("off", meta.url) is None


def test_watcher_hands_out_each_notice_once(meta):
    watcher = SpotWatcher(AwsImds(meta.url), interval=0.05)
    watcher.start()
    try:
        meta.notice_aws(seconds_from_now=100)
        deadline = time.monotonic() + 10
        notice = None
        while notice is None and time.monotonic() < deadline:
            notice = watcher.take()
            time.sleep(0.05)
        assert notice is not None and notice.kind == "terminate"
        time.sleep(0.3)
        assert watcher.take() is None
    finally:
        watcher.close()
