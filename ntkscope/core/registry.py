"""A registry: the named objects an extension point holds (arm kinds, warm-up signals), each
added once and looked up by name, a miss said in one line that lists what there is."""

from __future__ import annotations

from ntkscope.core.checks import fail


class Registry(dict):
    """{name: object}, in the order they were added. ``what`` names the objects in refusals
    ("arm kind", "signal")."""

    def __init__(self, what: str):
        super().__init__()
        self.what = what

    def add(self, name: str, item, *, replace: bool = False, func: str = "register"):
        """Add ``item`` under ``name`` (``replace``: over one of that name); returns ``item``."""
        if not isinstance(name, str) or not name.replace("-", "").replace("_", "").isalnum():
            raise fail(func, "name", f"must name the {self.what} with letters, digits, '-' and '_'", name)
        if name in self and not replace:
            raise fail(func, "name", f"is a registered {self.what} already (replace=True to change it)", name)
        self[name] = item
        return item

    def get_one(self, name: str, func: str = "get"):
        """The object registered as ``name``."""
        if name not in self:
            raise fail(func, "name", f"must be a registered {self.what} ({', '.join(self)})", name)
        return self[name]
