"""transformers' ContinuousBatchingConfig across the versions GPU machines ship (5.17 on).

Some releases name the tokens-per-page field `page_size`, others only `block_size`. The benchmarks build and
read the config through these two functions, which look at the fields the installed class really has.
"""

from __future__ import annotations

import dataclasses
from typing import Any

PAGE_FIELDS = ("page_size", "block_size")  # preferred first


def field_names(cls: type) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    import inspect

    return set(inspect.signature(cls).parameters)


def page_field(cls: type) -> str:
    """The name under which `cls` takes the page size."""
    names = field_names(cls)
    for name in PAGE_FIELDS:
        if name in names:
            return name
    raise TypeError(f"{cls.__name__} has none of the fields {PAGE_FIELDS}")


def make_cb_config(cls: type | None = None, page_size: int | None = None, **fields: Any) -> Any:
    """`cls(**fields)` with the page size under the field name `cls` has; fields it lacks are refused by name.
    `cls` defaults to transformers.ContinuousBatchingConfig."""
    if cls is None:
        from transformers import ContinuousBatchingConfig as cls  # noqa: N813
    names = field_names(cls)
    missing = sorted(k for k in fields if k not in names)
    if missing:
        raise TypeError(f"{cls.__name__} has no field(s) {missing}")
    if page_size is not None:
        fields[page_field(cls)] = page_size
    return cls(**fields)


def page_size_of(config: Any) -> int | None:
    """The page size a config object holds, whichever field carries it."""
    for name in PAGE_FIELDS:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None
