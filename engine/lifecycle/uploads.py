"""Uploaded model directories, on the scheduler's side.

A load request may name a directory the frontend wrote a client's model files into
(engine/lifecycle/upload_files.py). From then on the scheduler owns it: the lifecycle loads the model
from it, and ``UploadDirs.sweep`` removes it once no version loads, serves or drains from it
(after an unload, a replacement by another load, a failed load). The launcher removes whatever is
left with the run directory at exit, or at the next start after a crash.
"""
from __future__ import annotations

import logging
import os
import shutil

log = logging.getLogger("shmserve.scheduler")


class UploadDirs:
    def __init__(self, root: str):
        self.root = os.path.realpath(root) if root else ""
        self.owned: set[str] = set()

    def adopt(self, path: str) -> bool:
        """Take over a directory a frontend wrote. Anything but a real directory right under the
        upload root is refused and left untouched: a message must not make us remove a tree."""
        if not self.root or os.path.islink(path) or not os.path.isdir(path):
            return False
        if os.path.dirname(os.path.realpath(path)) != self.root:
            return False
        self.owned.add(path)
        return True

    def sweep(self, in_use: set[str]) -> None:
        """Remove every owned directory that no model version uses any more."""
        for path in [p for p in self.owned if p not in in_use]:
            self.owned.discard(path)
            shutil.rmtree(path, ignore_errors=True)
            log.info("removed uploaded model directory %s", path)

    def removed(self, path: str) -> bool:
        """Whether ``path`` was an upload directory that is gone now."""
        return bool(self.root) and os.path.dirname(path) == self.root \
            and path not in self.owned
