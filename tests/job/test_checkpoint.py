"""Checkpoint files: atomic commit, manifest contents, retention, corrupt and hostile checkpoints."""
from __future__ import annotations

import io
import json
import logging
import re
import pickle
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from job.checkpoint import (STATE_FILE, Checkpointer, _without_torch_crc32, describe, load_state_file, model_sha256,
                            open_checkpoint)
from job.exceptions import CheckpointLoadError, Diverged
from tests.support.checkpoints import checkpoints_of, make_checkpoint, zip_crc32s
from tests.support.jobs import ckpt_config, train_state
from tests.support.polling import wait_until
from uploader import local
from uploader.hashing import BLOCK_SIZE, file_digest, sha256_file
from uploader.manifest import FORMAT_VERSION, FileEntry, Manifest


@pytest.fixture
def saved(tiny_config, ckpt_dir):
    """A run of 40 batches that saved every 10 (synchronously, so none is deferred), keeping 3: 20, 30, 40 remain."""
    state = train_state(tiny_config(max_duration="40ba"),
                        ckpt_config(ckpt_dir, interval="10ba", keep=3, async_save=False))
    return state, ckpt_dir


def test_checkpoints_are_committed_with_a_manifest_and_pruned(saved):
    state, folder = saved
    assert [c.step for c in local.list_committed(folder)] == [20, 30, 40]
    assert not [p for p in folder.iterdir() if p.name.startswith(local.STAGING_PREFIX)]
    newest = folder / local.checkpoint_name(40)
    doc = json.loads((newest / "manifest.json").read_text())
    assert doc["format_version"] == FORMAT_VERSION
    assert doc["step"] == 40
    assert doc["timer"] == state.timer.state_dict()
    (entry,) = doc["files"]
    assert entry["block_size"] == BLOCK_SIZE
    assert (entry["size"], entry["blake3"]) == file_digest(newest / STATE_FILE, BLOCK_SIZE)  # format 3
    assert doc["meta"]["seed"] == 7


def test_checkpoint_files_carry_no_torch_crc32_and_a_users_torch_save_keeps_it(saved, tmp_path):
    """BLAKE3 verifies every byte of a checkpoint: torch's own CRC-32 of each record would be CPU taken from
    training for nothing, so the job's saves skip it; torch's setting is back once they end."""
    _, folder = saved
    assert zip_crc32s((folder / local.checkpoint_name(40) / STATE_FILE).read_bytes()) == {0}
    torch.save({"w": torch.ones(3)}, tmp_path / "own.pt")
    assert 0 not in zip_crc32s((tmp_path / "own.pt").read_bytes())


def test_overlapping_saves_keep_the_crc32_off_until_the_last_ends():
    """The writer thread and a rank's sharded write may overlap: the first to end must not turn it back on."""
    first, second = _without_torch_crc32(), _without_torch_crc32()
    first.__enter__()
    second.__enter__()
    try:
        first.__exit__(None, None, None)
        assert not torch.serialization.get_crc32_options()
    finally:
        second.__exit__(None, None, None)
    assert torch.serialization.get_crc32_options()


def _nan_weight(state):
    with torch.no_grad():
        next(state.model.parameters())[0] = float("nan")


def _inf_moment(state):
    moments = next(iter(state.optimizers[0].state.values()))
    moments["exp_avg_sq"].fill_(float("inf"))


def _scale_backed_off_to_0(state):
    state.scaler = torch.amp.GradScaler("cpu", init_scale=0.0)


@pytest.mark.parametrize("async_save", [False, True], ids=["save", "save_async"])
@pytest.mark.parametrize(("diverge", "said"), [
    (_nan_weight, r"model\.\S+\.weight holds NaN or Inf"),
    (_inf_moment, r"optimizers\.AdamW\.state\.0\.exp_avg_sq holds NaN or Inf"),
    (_scale_backed_off_to_0, r"the loss scale \(--precision amp_fp16, GradScaler\) is 0, and from there every step "
                             r"overflows"),
])
def test_a_state_that_diverged_is_never_written(saved, async_save, diverge, said):
    """Written, it would have replaced step 40 (a re-save of the same step) and pushed the good ones out of
    retention after --keep saves; it is Diverged (exit 8) instead, the folder as it was."""
    state, folder = saved
    before = checkpoints_of(folder)
    diverge(state)
    checkpointer = Checkpointer(folder, keep=3, meta={})
    kept = rf"that checkpoint is not written, and the ones before it are kept \(newest in {re.escape(str(folder))}: "
    with pytest.raises(Diverged, match=rf"^training diverged at step 40: {said}; {kept}step 40\)"):
        if async_save:
            assert checkpointer.save_async(state)
            wait_until(checkpointer.write_failed, timeout=60, what="the writer's failure, seen without waiting")
            checkpointer.wait()
        else:
            checkpointer.save(state)
    assert checkpoints_of(folder) == before
    assert not [p for p in folder.iterdir() if p.name.startswith(local.STAGING_PREFIX)]


def test_newest_complete_checkpoint_is_chosen(saved):
    _, folder = saved
    found = Checkpointer(folder, 3, {}).newest()
    assert found is not None and found[0].step == 40


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_truncate, _flip_byte, lambda p: p.unlink()], ids=["truncated", "bitflip", "missing"])
def test_corrupt_newest_is_skipped_with_a_warning(saved, damage, caplog):
    _, folder = saved
    damage(folder / local.checkpoint_name(40) / STATE_FILE)
    with caplog.at_level(logging.WARNING):
        found = Checkpointer(folder, 3, {}).newest()
    assert found is not None and found[0].step == 30
    assert any("skipping corrupt checkpoint" in r.getMessage() for r in caplog.records)


def test_incomplete_checkpoint_without_manifest_is_invisible(saved):
    _, folder = saved
    (folder / local.checkpoint_name(40) / "manifest.json").unlink()
    assert [c.step for c in local.list_committed(folder)] == [20, 30]


def test_resume_after_corruption_uses_previous_checkpoint(tiny_config, saved):
    _, folder = saved
    _flip_byte(folder / local.checkpoint_name(40) / STATE_FILE)
    state = train_state(tiny_config(max_duration="40ba"), ckpt_config(folder, interval="10ba"), stop_at=0)
    assert state.timer.batch.value == 30  # resumed from the previous checkpoint, not from scratch


def test_resume_refuses_when_every_checkpoint_is_corrupt(tiny_config, saved):
    """Not a silent restart from step 0: the work in them may be recoverable, and --resume never says so."""
    _, folder = saved
    for step in (20, 30, 40):
        _flip_byte(folder / local.checkpoint_name(step) / STATE_FILE)
    before = checkpoints_of(folder)
    with pytest.raises(CheckpointLoadError, match=r"none of the 3 checkpoint\(s\) in .* verifies.*--resume never"):
        train_state(tiny_config(max_duration="40ba"), ckpt_config(folder, interval="10ba"), stop_at=0)
    # Set aside for inspection (renamed corrupt-step-...-<time>), every byte kept; the next start says so too.
    assert local.list_committed(folder) == [] and len(local.list_set_aside(folder)) == 3
    assert {re.sub(r"^corrupt-(step-\d+)-[^/]+", r"\1", k): v for k, v in checkpoints_of(folder).items()} == before
    with pytest.raises(CheckpointLoadError, match=r"failed verification \(set aside.*--resume never"):
        train_state(tiny_config(max_duration="40ba"), ckpt_config(folder, interval="10ba"), stop_at=0)
    state = train_state(tiny_config(max_duration="10ba"), ckpt_config(folder, interval="10ba", resume="never"))
    assert state.timer.batch.value == 10  # the way out the message names


class _Exploit:
    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return (Path.touch, (self.sentinel,))


def _as_format(ckpt_path: Path, version: int) -> None:
    """Rewrite a checkpoint's manifest the way an older release wrote it: format 1, a plain sha256 and no
    block_size; format 2, sha256 block digests."""
    manifest = Manifest.read(ckpt_path)
    if version == 1:
        files = tuple(FileEntry(f.path, *sha256_file(ckpt_path / f.path)) for f in manifest.files)
    else:
        files = tuple(FileEntry(f.path, *file_digest(ckpt_path / f.path, BLOCK_SIZE, algorithm="sha256"), BLOCK_SIZE,
                                "sha256") for f in manifest.files)
    (ckpt_path / "manifest.json").write_bytes(replace(manifest, files=files, format_version=version).to_json())


@pytest.mark.parametrize("version", [1, 2])
def test_an_older_format_checkpoint_resumes_bit_for_bit_and_is_still_checked(tiny_config, saved, version):
    state, folder = saved
    for step in (30, 40):
        _as_format(folder / local.checkpoint_name(step), version)
    newest = folder / local.checkpoint_name(40)

    resumed = train_state(tiny_config(max_duration="40ba"), ckpt_config(folder, interval="10ba"), stop_at=0)

    assert resumed.timer.batch.value == 40
    assert model_sha256(resumed.model.state_dict()) == model_sha256(state.model.state_dict())
    entry = json.loads((newest / "manifest.json").read_text())
    assert entry["format_version"] == version and "sha256" in entry["files"][0]
    assert ("block_size" in entry["files"][0]) == (version == 2)
    _flip_byte(newest / STATE_FILE)
    found = Checkpointer(folder, 3, {}).newest()
    assert found is not None and found[0].step == 30


def write_hostile_checkpoint(folder: Path, sentinel: Path) -> Path:
    """A checkpoint whose manifest is valid but whose state file runs code when unpickled."""
    staging = local.staging_dir(folder, 5)
    with open(staging / STATE_FILE, "wb") as f:
        torch.save({"model": _Exploit(sentinel)}, f)
    size, digest = file_digest(staging / STATE_FILE, BLOCK_SIZE)
    return local.commit(staging, Manifest(step=5, files=(FileEntry(STATE_FILE, size, digest, BLOCK_SIZE),))).path


def test_hostile_pickle_is_refused_and_never_executed(tmp_path):
    sentinel = tmp_path / "pwned"
    path = write_hostile_checkpoint(tmp_path / "ckpts", sentinel)
    with pytest.raises(CheckpointLoadError, match="refusing to load .* pickled code"):
        load_state_file(path)
    assert not sentinel.exists()
    # Plain pickle of the same object would have run it: the test object really is hostile.
    pickle.loads(pickle.dumps(_Exploit(sentinel)))
    assert sentinel.exists()


def test_describe_reports_position_and_model_hash(saved):
    state, folder = saved
    path, manifest = open_checkpoint(folder)
    info = describe(path, manifest)
    assert (info["step"], info["epoch"], info["samples"]) == (40, 0, 40 * 64)
    assert info["model_sha256"] == model_sha256(state.model.state_dict())


def test_model_sha256_changes_with_any_weight():
    sd = {"w": torch.zeros(3), "b": torch.ones(2)}
    before = model_sha256(sd)
    sd["w"][1] = 1e-30
    assert model_sha256(sd) != before


def test_open_checkpoint_refuses_a_non_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointLoadError, match="no complete checkpoint"):
        open_checkpoint(tmp_path / "empty")
    with pytest.raises(CheckpointLoadError, match="not a checkpoint folder"):
        open_checkpoint(tmp_path / "nope")


def test_training_on_from_a_loaded_checkpoint_never_changes_its_file(tiny_config, saved):
    """Checkpoints load memory-mapped: the resumed optimizer's state starts out as the file's pages,
    and the steps after the resume must write to private copies, never to the checkpoint."""
    _, folder = saved
    newest = folder / local.checkpoint_name(40)
    before = sha256_file(newest / STATE_FILE)
    keep_all = ckpt_config(folder, interval="1000ba", keep=100)
    assert train_state(tiny_config(max_duration="55ba"), keep_all).timer.batch.value == 55
    assert sha256_file(newest / STATE_FILE) == before
    Manifest.read(newest).verify(newest)


def test_announce_hands_over_only_a_checkpoint_whose_commit_held_it_back(tmp_path: Path) -> None:
    """On nodes with disks of their own a save goes up only when no node is still uploading; the one a run
    ends on is handed over afterwards (job.app). Nothing else is: not a checkpoint this process resumed or
    never committed (every node leader of a shared volume uploaded the whole final checkpoint again), nor
    one older than a checkpoint handed over since."""
    uploads: list[int] = []
    ck = Checkpointer(tmp_path, keep=5, meta={}, on_commit=lambda c: uploads.append(c.step))
    make_checkpoint(tmp_path, 2)  # another process's (or an earlier life's)
    ck.announce(2)

    def commit(step: int, announce: bool) -> None:
        staging = local.staging_dir(tmp_path, step)
        (staging / STATE_FILE).write_bytes(bytes([step]) * 1000)
        size, digest = file_digest(staging / STATE_FILE, BLOCK_SIZE)
        manifest = Manifest(step=step, files=(FileEntry(STATE_FILE, size, digest, BLOCK_SIZE),), timer={}, meta={})
        ck._commit(staging, manifest, 0.0, announce=announce)

    commit(4, announce=False)
    assert uploads == []
    ck.announce(4)
    ck.announce(4)
    assert uploads == [4]
    commit(6, announce=False)
    commit(8, announce=True)
    ck.announce(6)  # 8 went up since
    assert uploads == [4, 8]


@pytest.mark.parametrize("mmap", [True, False], ids=["a-whole-file", "a-byte-range"])
def test_a_file_whose_shared_objects_unfold_past_any_state_is_refused_as_it_loads(tmp_path, mmap):
    """A pickle stores a shared object once: 1.4 KB held a list shared 40 levels deep, and torch's optimizer
    load, the RNG restore and every repr walked its 2**40 places (a hung start-up, 24 GB). Sharing within
    bounds loads, as a model's tied weights do."""
    from job.safe_load import MAX_PLACES, load_weights_only

    shared: list = [0.5]
    for _ in range(40):
        shared = [shared, shared]
    cycle: list = [0.5]
    cycle.append(cycle)
    tied = torch.zeros(3)
    for name, tree, says in [("dag", {"rng": shared}, f"number more than {MAX_PLACES:,}"),
                             ("cycle", {"rng": cycle}, "a container in it holds itself"),
                             ("tied", {"a": tied, "b": tied, "list": [[1, 2]] * 1000}, None)]:
        torch.save(tree, tmp_path / name)
        source = tmp_path / name if mmap else io.BytesIO((tmp_path / name).read_bytes())
        if says is None:
            loaded = load_weights_only(source, name, mmap=mmap)
            assert loaded["a"] is loaded["b"] and loaded["list"] == [[1, 2]] * 1000
        else:
            with pytest.raises(CheckpointLoadError, match=f"{name} is damaged or hostile: .*{re.escape(says)}"):
                load_weights_only(source, name, mmap=mmap)


@pytest.mark.parametrize("mmap", [True, False], ids=["a-whole-file", "a-byte-range"])
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning",  # torch's own, about quantized tensors
                            "ignore:TypedStorage is deprecated:UserWarning")
def test_tensors_views_and_packed_dtypes_a_real_state_holds_load(tmp_path, mmap):
    """The check for views beyond their storage (job.safe_load) counts elements packed several to a byte:
    quint4x2 held 8 elements on 4 bytes and was refused as an expanded view (review). A view within its
    storage loads; one past it does not."""
    from job.safe_load import load_weights_only

    base = torch.randn(10)
    for name, tensor, refused in [
        ("quint4x2", torch.quantize_per_tensor(torch.rand(8), 0.1, 0, torch.quint4x2), False),
        ("quint2x4", torch.quantize_per_tensor(torch.rand(8), 0.1, 0, torch.quint2x4), False),
        ("a slice", base[2:5], False),
        ("a row broadcast to a batch of one", torch.arange(10).expand(1, -1), False),
        ("an expanded view", torch.zeros(1).expand(4), True),
    ]:
        torch.save({"t": tensor}, tmp_path / "f")
        source = tmp_path / "f" if mmap else io.BytesIO((tmp_path / "f").read_bytes())
        if refused:
            with pytest.raises(CheckpointLoadError, match="an expanded view"):
                load_weights_only(source, name, mmap=mmap)
        else:
            loaded = load_weights_only(source, name, mmap=mmap)["t"]
            same = loaded.int_repr() if loaded.is_quantized else loaded
            assert torch.equal(same, tensor.int_repr() if tensor.is_quantized else tensor), name


def test_another_node_leaders_clean_up_of_the_write_check_is_no_failure(tmp_path, monkeypatch):
    """Node leaders sharing a --save-folder claim it at once: one's clean-up of staging leftovers removed the
    other's write-check folder between its mkdir and rmdir, and that start failed (exit 7, "No such file or
    directory"; 2 % of starts with four of them, in review)."""
    from job.checkpoint import claim_folder

    folder = tmp_path / "ck"
    folder.mkdir()
    mkdir = Path.mkdir

    def then_another_leader_cleans(path: Path, *args, **kwargs) -> None:
        mkdir(path, *args, **kwargs)
        if path.parent == folder and path.name.startswith(local.STAGING_PREFIX):
            local.clean_staging(folder)

    monkeypatch.setattr(Path, "mkdir", then_another_leader_cleans)
    claim_folder(folder)
    assert list(folder.iterdir()) == []
