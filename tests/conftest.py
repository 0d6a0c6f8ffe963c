"""Shared fixtures. Heavy helpers live in tests/support/; this file only wires them as fixtures."""
from __future__ import annotations

# --- section: tiny model and data (owner: job/state) ---

# --- section: S3 server and fault proxy (owner: uploader) ---
