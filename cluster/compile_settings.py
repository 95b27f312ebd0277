"""The seed's compile configs and `default_compile_level` resolved to the torch.compile arguments of the two forwards
(worker/compiled.py applies them), as transformers' `resolve_compile_configs` does. Torch- and transformers-free."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# torch.compile modes whose inductor options turn on its own CUDA graphs (torch._inductor.list_mode_options())
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


@dataclass
class CompileSettings:
    """The torch.compile arguments of one forward: transformers' CompileConfig's fields and defaults."""

    fullgraph: bool = False
    dynamic: bool | None = None
    backend: Any = "inductor"  # a name, or a callable backend
    mode: str | None = "reduce-overhead"
    options: dict | None = None

    @classmethod
    def from_any(cls, obj: Any) -> "CompileSettings | None":
        """Accept None, ours, transformers' CompileConfig (or anything with its attributes) or a dict (TOML)."""
        if obj is None or isinstance(obj, cls):
            return obj
        names = [f.name for f in dataclasses.fields(cls)]
        if isinstance(obj, dict):
            if unknown := set(obj) - set(names):
                raise ValueError(f"unknown compile field(s) {sorted(unknown)} (known: {names})")
            data = dict(obj)
        else:
            data = {n: getattr(obj, n) for n in names if hasattr(obj, n)}
            if not data:
                raise TypeError(f"expected a CompileConfig, a dict or None, got {type(obj).__name__}")
        got = cls(**data)
        if not isinstance(got.fullgraph, bool) or not (got.dynamic is None or isinstance(got.dynamic, bool)):
            raise TypeError("fullgraph must be a bool and dynamic a bool or None")
        if got.options is not None and not isinstance(got.options, dict):
            raise TypeError("options must be a dict or None")
        if got.mode is not None and got.options:
            raise ValueError("torch.compile takes mode or options, not both (set mode=None to pass options)")
        return got

    @property
    def uses_cudagraphs(self) -> bool:
        """Whether inductor captures the compiled function in CUDA graphs of its own."""
        if self.options:
            return bool(self.options.get("triton.cudagraphs", False))
        return self.mode in CUDAGRAPH_MODES

    def torch_kwargs(self) -> dict[str, Any]:
        return {"fullgraph": self.fullgraph, "dynamic": self.dynamic, "backend": self.backend, "mode": self.mode,
                "options": self.options}

    def describe(self) -> str:
        backend = self.backend if isinstance(self.backend, str) else getattr(self.backend, "__name__", "callable")
        return (f"backend={backend} mode={self.mode} dynamic={self.dynamic} fullgraph={self.fullgraph}"
                + (f" options={self.options}" if self.options else ""))


def compile_decision(varlen_config: Any, decode_config: Any, level: int, *, paged_kernels: bool
                     ) -> tuple[CompileSettings | None, CompileSettings | None, list[str]]:
    """(varlen, decode) compile settings and notes: an explicit config wins, else the level's default, except for the
    varlen forward on the paged kernels' paths (its max_seqlen values change every step: every step would recompile)."""
    notes: list[str] = []
    # transformers' default CompileConfig of the level: 0 none; 1 inductor mode "default", dynamic shapes;
    # 2 mode "max-autotune-no-cudagraphs", dynamic; 3 the same, static
    default = None if level <= 0 else CompileSettings(fullgraph=False, dynamic=level <= 2, backend="inductor",
                                                      mode="max-autotune-no-cudagraphs" if level >= 2 else "default")
    varlen = CompileSettings.from_any(varlen_config)
    if varlen is None and default is not None:
        if paged_kernels:
            notes.append("varlen forward not compiled by default_compile_level: the paged kernels' varlen lengths "
                         "change every step (set varlen_compile_config to compile it anyway)")
        else:
            varlen = default
    decode = CompileSettings.from_any(decode_config) or default
    for name, got in (("varlen", varlen), ("decode", decode)):
        if got is not None:
            notes.append(f"{name} forward compiled: {got.describe()}")
    return varlen, decode, notes
