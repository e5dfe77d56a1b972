"""Logging set-up shared by every service (one line per record, with the service's name)."""

from __future__ import annotations

import logging
import os


def setup_logging(service: str) -> None:
    level = os.environ.get("PAGEDSERVE_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=level, format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s", force=True
    )
