"""job.storage.RemoteStore's downloads, waited for as a Pull: a stop ends the wait, and a download the job gave
up on never writes into the --save-folder after that."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from job.exceptions import StoppedBeforeTraining
from job.storage import RemoteConfig, RemoteStore
from tests.support.checkpoints import make_checkpoint
from tests.support.faultproxy import FaultProxy
from tests.support.s3server import Bucket, fast_config
from uploader.remote import open_remote
from uploader.sync import push

pytestmark = pytest.mark.s3


def test_a_node_download_given_up_on_a_stop_has_ended_before_its_folder_is_deleted(
    tmp_path: Path, s3_bucket: Bucket, fault_proxy: FaultProxy
) -> None:
    """job.node_pull deletes a node's scratch folder as soon as a stop ends the wait for its download. The
    download ran on in its thread: its listing, answered after the delete, made the folder anew, and the job
    left it in the --save-folder (CI of stop 45, test_multinode). Now the wait ends with the download."""
    ckpt = make_checkpoint(tmp_path / "local", 10)
    remote = open_remote(s3_bucket.url("run"), fast_config(s3_bucket.endpoint_url))
    push(ckpt, remote, keep=3)
    remote.close()
    fault_proxy.hold("list-type=2")  # the download's first request: the listing of the checkpoint's files
    cfg = RemoteConfig(s3_bucket.url("run"), "off", fast_config(fault_proxy.endpoint_url))
    store = RemoteStore(cfg, tmp_path / "save", stopped=lambda: "SIGTERM" if fault_proxy.counters.held else None)
    scratch = tmp_path / "save" / ".resume-node-0"
    try:
        with pytest.raises(StoppedBeforeTraining, match=r"^stopped \(SIGTERM\) while the checkpoint to resume"):
            store.pull_files(ckpt.manifest(), {f.path for f in ckpt.manifest().files}, scratch)
        shutil.rmtree(scratch, ignore_errors=True)  # as job.node_pull does on its way out
        fault_proxy.passthrough()  # the listing is answered now, had it still been waited for
    finally:
        store.close()
    assert not scratch.exists()
    assert fault_proxy.counters.held == 1
