"""The undefended baseline."""
from __future__ import annotations

from gleak.contracts.plugin import Defense
from gleak.contracts.registry import register_defense


@register_defense("none")
class NoDefense(Defense):
    """No defense: the observer sees the client's update as computed."""
