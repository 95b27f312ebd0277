"""`lockstep make-model`: a randomly initialised checkpoint written by transformers' own classes from a seeded
generator (nothing is downloaded), with a tokenizer of its vocabulary size (launch/make_tokenizer.py)."""

from __future__ import annotations

import argparse
import os
from contextlib import suppress
from pathlib import Path

SIZES = {
    # about 3.4M parameters: fast enough for parity tests of four architectures at two TP sizes
    "tiny": dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024),
    # about 100M parameters: the benchmark model
    "small": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                  num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048),
}
ARCHS = ("llama", "mistral", "qwen2", "qwen3")
BOS, EOS = 1, 2


def make_model(out_dir: str | os.PathLike, arch: str = "llama", size: str = "tiny", seed: int = 0,
               tokenizer: bool | None = None, **overrides) -> Path:
    """Write a checkpoint to out_dir and return its path. `tokenizer`: None writes one when the vocabulary can
    hold a byte-level BPE, True insists (ValueError if it cannot), False writes none. `overrides`: config fields."""
    import torch
    import transformers
    from transformers import GenerationConfig

    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r} is not one of {ARCHS}")
    if size not in SIZES:
        raise ValueError(f"size {size!r} is not one of {tuple(SIZES)}")
    fields = dict(SIZES[size], bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False, rms_norm_eps=1e-6)
    fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    if arch == "mistral":
        fields["sliding_window"] = None
    fields.update(overrides)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    config = config_cls(**fields)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=0,
                                               do_sample=False, max_new_tokens=32)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    from launch.make_tokenizer import make_tokenizer, min_vocab_size

    if tokenizer is None:  # by default, whenever the vocabulary can hold a byte-level BPE
        tokenizer = config.vocab_size >= min_vocab_size()
        if not tokenizer:
            print(f"make-model: no tokenizer (vocab_size={config.vocab_size} is below {min_vocab_size()})")
    if tokenizer:
        make_tokenizer(out, config.vocab_size)
    return out


def parse_overrides(pairs: list[str]) -> dict:
    """--set key=value pairs; values parsed as int, float, bool or None where they look like one."""
    out = {}
    for pair in pairs:
        key, _, raw = pair.partition("=")
        if not key or not _:
            raise SystemExit(f"--set expects key=value, got {pair!r}")
        value: object = raw
        for conv in (int, float):
            with suppress(ValueError):
                value = conv(raw)
                break
        out[key] = {"true": True, "false": False, "none": None}.get(raw.lower(), value)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="output directory")
    p.add_argument("--arch", choices=ARCHS, default="llama")
    p.add_argument("--size", choices=tuple(SIZES), default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set num_key_value_heads=1")
    p.add_argument("--no-tokenizer", action="store_true", help="write no tokenizer next to the weights")


def run(args: argparse.Namespace) -> int:
    out = make_model(args.dir, args.arch, args.size, args.seed, tokenizer=False if args.no_tokenizer else None,
                     **parse_overrides(args.set))
    print(f"wrote {args.arch}/{args.size} (seed {args.seed}) to {out}")
    return 0
