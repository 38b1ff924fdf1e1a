"""Named registries: what a user adds by registering (algorithms, policy losses, dispatch modes), never by
editing an if-chain in the package. One place for the rules every registry shares: a name taken by other code
is refused (the same code registering again, a module imported twice, is not a clash), an unknown name is
an error listing the registered ones, and a user's module is imported by name."""
from __future__ import annotations

import importlib
from typing import Any, Callable


class Registry(dict):
    """name -> registered thing. `kind` names it in errors ("policy loss"); `how` says how to add one."""

    def __init__(self, kind: str, how: str) -> None:
        super().__init__()
        self.kind, self.how = kind, how
        self.origins: dict[str, tuple[str, str]] = {}  # name -> where the code that registered it is defined

    def add(self, name: str, value: Any, code: Callable) -> None:
        """Register `value` as `name`; `code` is the function that identifies who registers it."""
        if name in self.origins and self.origins[name] != origin(code):
            raise ValueError(f"{self.kind} {name!r} is already registered by {'.'.join(self.origins[name])}; "
                             f"pick another name")
        self[name], self.origins[name] = value, origin(code)

    def pop(self, name: str, *default: Any) -> Any:
        """Forget `name` (tests register and drop their own)."""
        self.origins.pop(name, None)
        return super().pop(name, *default)

    def lookup(self, name: str, subject: str | None = None, where: str = "") -> Any:
        """The thing registered as `name`, or a ValueError naming the registered ones. `subject`: how the error
        names the request (default "<kind> '<name>'"); `where`: why it is missing, e.g. " (module X ...)"."""
        if name not in self:
            raise ValueError(f"{subject or f'{self.kind} {name!r}'} is unknown{where}; registered: "
                             f"{', '.join(sorted(self))} (a new one: {self.how})")
        return self[name]


def origin(fn: Callable) -> tuple[str, str]:
    """Where a function was defined (its module and qualified name)."""
    return getattr(fn, "__module__", "?"), getattr(fn, "__qualname__", repr(fn))


def import_user_module(module: str, option: str = "algorithm.module") -> None:
    """Import a user's module so that its registrations run; ValueError naming the option when it cannot be."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise ValueError(f"{option}={module!r} cannot be imported ({exc}); give an importable module path (on "
                         f"PYTHONPATH) that registers what it names") from None


def resolve_dotted(path: str, option: str) -> Any:
    """The object "package.module:name" (or "package.module.name") names, None when the module lacks it; a
    ValueError naming the option when the path is malformed or the module cannot be imported."""
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{option}={path!r} is not 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{option}={path!r}: cannot import module {module_name!r} ({exc}); is it on PYTHONPATH?") \
            from exc
    return getattr(module, attr, None)
