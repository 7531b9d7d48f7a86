"""Shutdown helper shared by the services."""
from __future__ import annotations

import logging


def close_attrs(owner, names, log: logging.Logger) -> None:
    """Call `.close()` on each attribute of `owner` that is set, in order.

    A failing close is logged and the rest still close: a service must release
    its engine, sockets and threads even when one of them is broken.
    """
    for name in names:
        obj = getattr(owner, name, None)
        if obj is None:
            continue
        try:
            obj.close()
        except Exception:  # noqa: BLE001 - close everything we can
            log.exception("closing %s failed", name)
