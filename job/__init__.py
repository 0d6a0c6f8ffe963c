"""The `job` CLI and the training loop that ties `state` and `uploader` together."""
