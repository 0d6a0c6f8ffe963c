"""The start-up write check: a remote the uploader may read but not write fails before any work.

Listing and reading are all a start-up pull needs, so credentials that may only read (a read-only
policy, the wrong role, a file:// volume mounted read-only) used to pass every start-up check and
fail at the first upload, one save interval into training; and a sidecar with nothing to upload
yet could wait for hours before finding out. The check writes one small object next to the
checkpoints and deletes it again: exactly the two rights an uploader needs beyond reading (writing
checkpoints, and deleting them for retention).

Its key is outside every checkpoint prefix (uploader.layout), so listings, pulls and retention never
see it, even one left behind by a process killed between the two requests. On a versioned bucket
each check leaves a tiny noncurrent version and a delete marker, as any deleted object does.
"""
from __future__ import annotations

import logging
import uuid

from uploader.exceptions import StorageError, TransientStorageError
from uploader.remote import Remote

logger = logging.getLogger(__name__)

PROBE_PREFIX = ".spot-trainer-write-check-"
PROBE_BODY = b"spot-trainer checks that it may write and delete here; this object is safe to delete\n"


def check_writable(remote: Remote) -> None:
    """Write and delete one small object; refusals are raised (their type and exit code unchanged),
    with the check named so the line says why a start-up that uploads nothing yet wrote at all.

    An unreachable remote is not this check's business: it is logged, and the uploads that follow
    ride it out under their own retries (the pull at start-up, if any, reports it anyway).
    """
    key = f"{PROBE_PREFIX}{uuid.uuid4().hex}"  # one of its own: two processes never delete each other's
    try:
        remote.write_bytes(key, PROBE_BODY)
        remote.delete([key])
    except TransientStorageError as e:
        logger.warning("could not check that %s is writable: %s", remote.url, e)
        return
    except StorageError as e:
        raise type(e)(f"{remote.url} is not writable (start-up write check): {e}") from None
    logger.debug("%s is writable (wrote and deleted %s)", remote.url, key)
