"""Training state: pure data and torch, no I/O policy (see README, "Architecture")."""
