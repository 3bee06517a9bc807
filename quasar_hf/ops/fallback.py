"""Make a slower fallback visible: one warning per (what, fallback, reason) and process."""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger("quasar_hf.ops")


@functools.cache
def warn_fallback_once(what: str, fallback: str, reason: str) -> None:
    """Log at warning level that `what` is unavailable (and why) and `fallback` runs instead.

    Cached on its arguments, so each distinct fallback is reported once per process; tests call
    `warn_fallback_once.cache_clear()` to see it again.
    """
    logger.warning("%s is unavailable, so %s runs instead (slower): %s", what, fallback, reason)
