"""The panel's messages as ``web/status_schema.json`` declares them, the one place their fields are named.

The report (``nodes/panel_messages.py``, for ``nodes/report.py``) builds every message through
``Message.build``, which refuses a field the schema lacks and a declared one left out (unless the schema says
when it may be): a renamed or forgotten field fails where the message is built, not in a browser. The panel
(``web/block_offload_panel.js``) reads the same fields by name; ``tests/test_panel_schema.py`` checks that both
sides agree with the file.

The file lives in ``web/`` beside the panel that reads its fields, and is served with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "web" / "status_schema.json"


@dataclass(frozen=True)
class Message:
    """One message (or part of one) of the schema: its fields in their declared order, and those always there."""

    name: str
    fields: tuple[str, ...]
    required: frozenset[str]
    declared: frozenset[str]

    def build(self, **values: Any) -> dict[str, Any]:
        """``values`` as the message, once they are exactly its fields (the optional ones may be left out)."""
        given = values.keys()
        if given != self.declared and (self.required - given or given - self.declared):
            missing, unknown = sorted(self.required - given), sorted(given - self.declared)
            raise ValueError(f"{self.name} message: {missing} missing, {unknown} not in {SCHEMA_PATH.name}")
        return values


def _message(name: str) -> Message:
    """The message ``name``; one that ``extends`` another has that one's fields first."""

    def fields_of(name: str) -> dict[str, dict[str, Any]]:
        message = _SCHEMA["messages"][name]
        base = fields_of(message["extends"]) if "extends" in message else {}
        return base | message["fields"]

    fields = fields_of(name)
    required = frozenset(field for field, spec in fields.items() if "absent_when" not in spec)
    return Message(name, tuple(fields), required, frozenset(fields))


_SCHEMA: Final = json.loads(SCHEMA_PATH.read_text())  # read once, never changed

VERSION: int = _SCHEMA["version"]
STATUS_EVENT: str = _SCHEMA["messages"]["status"]["event"]
REPORT_ROUTE: str = _SCHEMA["messages"]["report"]["route"]
TIMELINE_ROUTE: str = _SCHEMA["messages"]["timeline"]["route"]
# A unit's place in the placement string: on the device, streamed from a host buffer, or from its checkpoint file.
RESIDENT: str = _SCHEMA["placement_letters"]["resident"]
STREAMED: str = _SCHEMA["placement_letters"]["streamed"]
FROM_FILE: str = _SCHEMA["placement_letters"]["from_file"]

STATUS = _message("status")
REPORT = _message("report")
MEMORY = _message("memory")
MODEL = _message("model")
STEP = _message("step")
SPAN = _message("span")
READ = _message("read")
FULL_STEP = _message("full_step")
TIMELINE = _message("timeline")
