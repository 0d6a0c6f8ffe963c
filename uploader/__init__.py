"""Storage side of spot-trainer: the on-disk checkpoint format and syncing it to remote storage.

This package must never import torch: the sidecar container runs it alone and stays small.

Map: manifest / local / hashing (the checkpoint format), config (UploadConfig), remote (the Remote
interface, open_remote) with s3 and filesystem behind it, retry (the one retry layer), parallel
(multipart engine), layout (remote keys), sync (push, pull, list, retention), worker
(BackgroundUploader for the job), watch (the sidecar loop), progress / console / cli (the command).
"""
