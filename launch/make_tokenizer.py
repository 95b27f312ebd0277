"""A tokenizer made locally for made checkpoints: a byte-level BPE trained on Python's own docstrings.

Nothing is downloaded: the training text is the docstrings of a fixed list of standard-library modules, in a fixed
order, so one Python version always makes the same tokenizer; past about 14.8k tokens the standard library's source
is added (32k tokens), so that every token decodes to text, and reserved special tokens fill what is left. Ids 0, 1,
2 are `<pad>`, `<s>`, `</s>`, then the ChatML markers. Saved as a transformers fast tokenizer with a ChatML chat
template; encoding prepends `<s>`.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import os
import sysconfig
import warnings
from pathlib import Path

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, IM_START, IM_END)  # ids 0..4, in this order
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                 "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{% endif %}")
# modules whose docstrings are the training text (imported without side effects; the order is fixed)
CORPUS_MODULES = (
    "abc", "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "collections", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum", "fractions", "functools", "gzip",
    "heapq", "hashlib", "html", "http.client", "inspect", "io", "ipaddress", "itertools", "json", "logging",
    "math", "operator", "os", "pathlib", "pickle", "pprint", "queue", "random", "re", "shutil", "socket",
    "sqlite3", "statistics", "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading",
    "tokenize", "typing", "unicodedata", "unittest", "urllib.parse", "uuid", "zipfile", "zoneinfo",
)


def corpus() -> list[str]:
    """The training text: each module's docstring and its members' (methods of classes too), in name order."""
    texts: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in CORPUS_MODULES:
            try:
                module = importlib.import_module(name)
            except ImportError:  # a Python built without it (sqlite3, zoneinfo's data): the text is smaller
                continue
            texts.append(inspect.getdoc(module) or "")
            for _, member in sorted(vars(module).items()):
                texts.append(_doc(member))
                if inspect.isclass(member):
                    texts.extend(_doc(m) for _, m in sorted(vars(member).items()))
    return [t for t in texts if t]


def source_corpus() -> list[str]:
    """More training text for large vocabularies: the standard library's top-level modules, in name order."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    return [p.read_text(encoding="utf-8", errors="replace") for p in sorted(lib.glob("*.py"))]


def _doc(obj: object) -> str:
    try:
        return (inspect.getdoc(obj) if callable(obj) or inspect.ismodule(obj) else None) or ""
    except Exception:  # a member whose attributes raise
        return ""


def min_vocab_size() -> int:
    """The smallest vocabulary a byte-level BPE fits in: every byte plus the special tokens."""
    return 256 + len(SPECIAL_TOKENS)


@functools.lru_cache(maxsize=4)  # in memory only: a test session makes many checkpoints of one vocabulary size
def _trained(vocab_size: int) -> str:
    """The trained tokenizer (tokenizers' JSON), filled to vocab_size with reserved special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < min_vocab_size():
        raise ValueError(f"vocab_size={vocab_size} is below the {min_vocab_size()} tokens a byte-level BPE needs")

    def train(texts: list[str]) -> Tokenizer:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                      show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts, trainer)
        return tok

    docs = corpus()
    tok = train(docs)
    if tok.get_vocab_size(with_added_tokens=True) < vocab_size:  # the docstrings ran out of merges
        tok = train(docs + source_corpus())
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is below the {size} tokens a byte-level BPE needs")
    tok.add_special_tokens([AddedToken(f"<|reserved_{i}|>", special=True) for i in range(vocab_size - size)])
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, bos)])
    return tok.to_str()


def make_tokenizer(out_dir: str | os.PathLike, vocab_size: int) -> Path:
    """Train (or reuse this process's) tokenizer of `vocab_size` tokens and save it to out_dir."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_trained(vocab_size)), pad_token=PAD,
                                   bos_token=BOS, eos_token=EOS, clean_up_tokenization_spaces=False,
                                   model_max_length=1 << 30)
    fast.chat_template = CHAT_TEMPLATE
    if len(fast) != vocab_size or fast.convert_tokens_to_ids([PAD, BOS, EOS]) != [0, 1, 2]:
        raise AssertionError(f"made a tokenizer of {len(fast)} tokens for vocab_size={vocab_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("dir")
    p.add_argument("--vocab-size", type=int, default=2048)
    args = p.parse_args()
    print(f"wrote a tokenizer of {args.vocab_size} tokens to {make_tokenizer(args.dir, args.vocab_size)}")


if __name__ == "__main__":
    main()
