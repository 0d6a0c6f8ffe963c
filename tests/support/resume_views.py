"""Under torchrun (CPU, gloo): job.resume.resume of the newest checkpoint in FOLDER on every rank, then each
rank writes ``OUT/rank-R.json``: ``{"rank": r, "step": s, "model": sha256 of the model's weights}``.

``python -m tests.support.resume_views FOLDER same|other|unreadable OUT``: with ``other``, rank 1 sees no file
where rank 0 chose one, as a rank on another machine sees its own disk (a launcher that does not set
LOCAL_WORLD_SIZE makes every rank look like one node's); with ``unreadable``, rank 1 sees the file but fails to
read it. A rank whose resume raises CheckpointLoadError writes ``{"rank": r, "step": null, "error": message}``.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from job import distributed
from job import resume as resume_module
from job.app import run_meta
from job.build import build
from job.checkpoint import Checkpointer
from job.cli import torchrun_env
from job.exceptions import CheckpointLoadError
from tests.support.jobs import ckpt_config, train_config


def main(folder: str, view: str, out: str) -> None:
    distributed.init(torchrun_env(), "cpu")
    if view == "other" and distributed.rank() == 1:
        resume_module.file_identity = lambda path: None  # type: ignore[assignment]
    if view == "unreadable" and distributed.rank() == 1:
        resume_module.load_state_file = _unreadable  # type: ignore[assignment]
    cfg = train_config()
    run = build(cfg, defer_init=True)
    ckpt = ckpt_config(Path(folder))
    meta = run_meta(cfg)
    try:
        resumed = resume_module.resume(run.state, ckpt, Checkpointer(ckpt.folder, ckpt.keep, meta), meta, None)
    except CheckpointLoadError as e:
        found = {"rank": distributed.rank(), "step": None, "error": str(e)}
    else:
        weights = b"".join(t.detach().contiguous().numpy().tobytes() for t in run.state.model.state_dict().values())
        found = {"rank": distributed.rank(), "step": run.state.timer.batch.value if resumed else None,
                 "model": hashlib.sha256(weights).hexdigest()}
    (Path(out) / f"rank-{distributed.rank()}.json").write_text(json.dumps(found))


def _unreadable(folder: Path, manifest: object = None) -> dict:
    raise CheckpointLoadError(f"rank 1 cannot read {folder / 'state.pt'} (tests.support.resume_views)")


if __name__ == "__main__":
    main(*sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # never through gloo's destructors (job.distributed.joined): they abort or hang at exit
