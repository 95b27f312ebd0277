"""The table a family declares between checkpoint tensor names and the layers that load them.

A rule pairs a checkpoint name template with a module path template and a part template, sharing placeholders:
`{L}` (a layer index), `{E}` (an expert index) and `{kind}` (`weight` or `bias`; a template without it names a
weight). `model.layers.{L}.self_attn.q_proj.{kind}` -> module `layers.{L}.self_attn.qkv_proj`, part `q`. Rules
map both ways: a checkpoint name to (module, part, kind) when loading, and a module's parts back to the names a
complete checkpoint must hold. An `alias` rule names a tensor that covers several of those names at once (a
fused layout, e.g. transformers' in-memory `mlp.experts.gate_up_proj`): it loads, but is never required."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

_FIELD = re.compile(r"\{(\w+)\}")
_PATTERNS = {"L": r"\d+", "E": r"\d+", "kind": r"weight|bias"}


def _regex(template: str) -> re.Pattern[str]:
    out, at = [], 0
    for m in _FIELD.finditer(template):
        out.append(re.escape(template[at:m.start()]))
        out.append(f"(?P<{m.group(1)}>{_PATTERNS[m.group(1)]})")
        at = m.end()
    return re.compile("".join(out) + re.escape(template[at:]) + r"\Z")


@dataclass(frozen=True)
class NameRule:
    checkpoint: str  # e.g. "model.layers.{L}.mlp.experts.{E}.gate_proj.{kind}"
    module: str  # e.g. "layers.{L}.mlp.experts"
    part: str = ""  # e.g. "gate.{E}"
    alias: bool = False  # a fused name that covers the parts `module.covered_parts(part)` lists
    _checkpoint_re: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _module_re: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _part_re: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_checkpoint_re", _regex(self.checkpoint))
        object.__setattr__(self, "_module_re", _regex(self.module))
        object.__setattr__(self, "_part_re", _regex(self.part))

    def from_checkpoint(self, name: str) -> tuple[str, str, str] | None:
        """(module path, part, kind) of checkpoint name `name`, or None when this rule does not name it."""
        m = self._checkpoint_re.match(name)
        if m is None:
            return None
        values = m.groupdict()
        return self.module.format(**values), self.part.format(**values), values.get("kind", "weight")

    def to_checkpoint(self, module: str, part: str, kind: str) -> str | None:
        """The checkpoint name of (module path, part, kind), or None when this rule does not cover it."""
        if "{kind}" not in self.checkpoint and kind != "weight":
            return None
        m, p = self._module_re.match(module), self._part_re.match(part)
        if m is None or p is None:
            return None
        return self.checkpoint.format(**m.groupdict(), **p.groupdict(), kind=kind)


@dataclass(frozen=True)
class Target:
    """What loads one checkpoint tensor: `layer.shard_of(part, kind, src)`; `covers`: the required names it fills
    (itself, or every name a fused alias stands for)."""

    layer: Any
    part: str
    kind: str
    covers: tuple[str, ...]


@dataclass(frozen=True)
class NameTable:
    rules: tuple[NameRule, ...]

    def __add__(self, other: NameTable) -> NameTable:
        return NameTable(self.rules + other.rules)

    def from_checkpoint(self, name: str) -> tuple[NameRule, tuple[str, str, str]] | None:
        for rule in self.rules:
            found = rule.from_checkpoint(name)
            if found is not None:
                return rule, found
        return None

    def to_checkpoint(self, module: str, part: str, kind: str) -> str:
        for rule in self.rules:
            if not rule.alias and (name := rule.to_checkpoint(module, part, kind)) is not None:
                return name
        raise KeyError(f"no checkpoint name for {module} part {part!r} ({kind}): the family's table lacks a rule")
