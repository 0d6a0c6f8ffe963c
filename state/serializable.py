"""The one protocol every checkpointed object follows."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


class Serializable:
    """Base for objects whose progress must survive preemption.

    The defaults make a stateless object (an algorithm or callback with nothing to remember) checkpointable
    without boilerplate, so State can treat every member of its lists uniformly.
    """

    def state_dict(self) -> dict[str, Any]:
        """Return what is needed to continue exactly where this object left off."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`; stateless objects have nothing to restore."""
        del state
