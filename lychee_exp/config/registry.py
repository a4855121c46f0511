"""Named parts that a config key chooses between (losses, optimizers): a new part is one registered function
plus one YAML file in its config group, and the registry lists the allowed names when a config names another."""

from __future__ import annotations

from typing import Callable, TypeVar

from lychee_exp.errors import UserError

F = TypeVar("F", bound=Callable)


class Registry(dict):
    def __init__(self, key: str):
        super().__init__()
        self.key = key  # the config key that names a part, for error messages

    def register(self, name: str) -> Callable[[F], F]:
        def add(part: F) -> F:
            if name in self:
                raise ValueError(f"{self.key}: {name!r} is registered twice")
            self[name] = part
            return part

        return add

    def lookup(self, name: str) -> Callable:
        if name not in self:
            raise UserError(f"{self.key}={name!r} is not one of {', '.join(sorted(self))}")
        return self[name]
