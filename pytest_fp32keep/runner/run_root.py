"""Where a session's launches keep their logs, stack dumps and rendezvous files.

With pytest's ``tmpdir`` plugin (the usual case) that is ``fsdp2/`` in the session's basetemp,
beside the ``tmp_path`` folders, kept and rotated the way pytest keeps its basetemps. Without it
(``-p no:tmpdir``) there is no basetemp: the launches get a private folder of their own, made
fresh (``0700``, a name no one else can take) and removed when the session ends, rather than a
fixed path under the temporary directory that every session of every user would share.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest


class RunRoot:
    """The folder the session's launches are made in, found or made on first use."""

    def __init__(self, config: pytest.Config) -> None:
        self._config = config
        self._path: Path | None = None
        self.owned = False  # made here (no basetemp): removed by :meth:`remove`

    def path(self) -> Path:
        """The folder, made on the first call."""
        if self._path is None:
            factory = getattr(self._config, "_tmp_path_factory", None)
            if factory is not None:
                self._path = Path(factory.getbasetemp()) / "fsdp2"
                self._path.mkdir(parents=True, exist_ok=True)
            else:
                self._path = Path(tempfile.mkdtemp(prefix="pytest-fp32keep-"))
                self.owned = True
        return self._path

    def remove(self) -> None:
        """Remove the folder if it was made here (call once no rank writes in it any more)."""
        if self.owned and self._path is not None:
            shutil.rmtree(self._path, ignore_errors=True)
            self._path = None
            self.owned = False
