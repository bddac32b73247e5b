"""Tessera's log output: INFO and above to stderr unless the application configured logging.

Start-up facts (KV-cache blocks, the profile run) are worth seeing, as in vLLM; set
TESSERA_LOG_LEVEL=WARNING to quiet them.
"""

from __future__ import annotations

import logging
import os


def configure_logging() -> None:
    logger = logging.getLogger("tessera")
    if logger.handlers or logging.getLogger().handlers:  # the application (or pytest) handles logs
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("TESSERA_LOG_LEVEL", "INFO").upper())
    logger.propagate = False
