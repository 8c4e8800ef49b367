"""What the controller keeps across its own restarts (`state_file`): each endpoint's learned
baselines and the original max_num_seqs of every engine it lowered. A controller killed
mid-episode and restarted by the supervisor then judges against the healthy baseline
instead of learning the contended latency as normal, and restores a lowered engine to what
it was. Written atomically; a missing or unreadable file is an empty state."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

__all__ = ["StateStore"]

log = logging.getLogger("unbroken.controller")


class StateStore:
    def __init__(self, path: str | None) -> None:
        self.path = Path(path) if path else None
        # engine URL -> its max_num_seqs before the controller lowered it
        self.engines: dict[str, int] = {}
        # endpoint name -> {"url": ..., "cuda": {...}, "itl": {...}}
        self.baselines: dict[str, dict[str, Any]] = {}
        self._written: str | None = None  # what the file holds since this process wrote it
        if self.path is None:
            return
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            log.warning("controller state %s unreadable (%s): starting without it", self.path, e)
            return
        if isinstance(data, dict):
            eng = data.get("engines")
            if isinstance(eng, dict):
                self.engines = {
                    str(k): int(v) for k, v in eng.items() if isinstance(v, int) and v >= 1
                }
            bl = data.get("baselines")
            if isinstance(bl, dict):
                self.baselines = {str(k): v for k, v in bl.items() if isinstance(v, dict)}

    def save(self) -> None:
        """Write the state, unless the file holds it already (the controller saves its
        baselines every few seconds, also while nothing was learned)."""
        if self.path is None:
            return
        text = json.dumps({"engines": self.engines, "baselines": self.baselines})
        if text == self._written:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(text)
            os.replace(tmp, self.path)
            self._written = text
        except OSError as e:
            log.warning("could not write the controller state %s: %s", self.path, e)
