"""Text from a plugin or a suite file shown to a person: never a terminal's escape sequence or control character.

A plugin's name, docstring or error and a suite's description are data. Printed raw, `\\x1b[2J` would clear the
reader's terminal and `\\x1b]0;...\\x07` retitle it; written raw into a Markdown or HTML leaderboard, ESC and its
kin are invisible bytes. Every place that prints or writes such text passes it through `strip_controls`.
"""
from __future__ import annotations

import re

# CSI (ESC [ ... final), OSC (ESC ] ... BEL or ESC \), and the two-character escapes (ESC and one of @-Z \ ] ^ _).
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-Z\\-_]?")
# The rest of C0 (line breaks and tabs kept), DEL and C1 (0x9b is a CSI of its own in some terminals).
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def strip_controls(text: str) -> str:
    """`text` without escape sequences and control characters; line breaks and tabs kept."""
    return _CONTROLS.sub("", _ESCAPES.sub("", str(text)))
