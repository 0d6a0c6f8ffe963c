"""Storage side of spot-trainer: the on-disk checkpoint format and syncing it to remote storage.

This package must never import torch: the sidecar container runs it alone and stays small.
"""
