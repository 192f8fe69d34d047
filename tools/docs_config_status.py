"""A griffe extension: each config field's status on top of its docstring in the config reference.

mkdocstrings renders the config reference from the models' attribute docstrings; this extension
(named in ``mkdocs.yml``) puts the status of every field that a non-available row of the
feature table covers (`status_tables.field_notes`) in front of that docstring, so the reference
says "planned" or "accepted, ignored" next to the key itself.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import griffe

sys.path.insert(0, str(Path(__file__).resolve().parent))

from status_tables import field_notes  # tools/ is not a package: found through sys.path

_CONFIG_MODULE = "deepshard.interface.config"


class ConfigStatus(griffe.Extension):
    """Prefixes the docstring of each covered config field with its status note."""

    def __init__(self) -> None:
        super().__init__()
        self._notes = field_notes()

    def on_attribute(self, *, attr: griffe.Attribute, **kwargs: Any) -> None:
        parent = attr.parent
        if parent is None or not parent.path.startswith(_CONFIG_MODULE):
            return
        note = self._notes.get((parent.name, attr.name))
        if note is None:
            return
        if attr.docstring is None:
            attr.docstring = griffe.Docstring(note, parent=attr)
        else:
            attr.docstring.value = f"{note}\n\n{attr.docstring.value}"
