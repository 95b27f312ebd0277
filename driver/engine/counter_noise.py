"""Counter-based sampling noise: Gumbel noise from an integer hash of (request key, token index, token id), so the
token a request samples is the same whatever batch it sits in, whatever the TP size or device, and however often it
was restarted. The hash is a sponge of 32-bit xorshift-multiply rounds in exact int64 arithmetic (`mix32_`)."""

from __future__ import annotations

import hashlib
import os

import torch

M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9  # added after each absorbed word, so that zero words still move the state
# a mixer from Wellons' hash-prospector ([16 21f0aaad 15 735a2d97 15]): xorshift-multiply, twice, then xorshift
S1, C1, S2, C2, S3 = 16, 0x21F0AAAD, 15, 0x735A2D97, 15
ROW_SALT, VOCAB_SALT = 0x2545F491, 0x85EBCA6B
U_BITS = 23  # u = (2m + 1) / 2**24 for a 23-bit m: exact in float32 and strictly inside (0, 1)


def request_key(own_seed: int | None, config_seed: int | None, request_id: str, child_index: int = -1) -> int:
    """A request's 64-bit noise key. Its own seed alone keys it, as a seed does in OpenAI's API and vLLM: the same
    seed samples the same tokens from the same logits, whatever the request id; child i of n samples of one prompt
    (`child_index` >= 0) is keyed by the seed and i, so the n samples differ. Without one, the engine's seed and the
    request id key it (requests differ, runs repeat); with no seed anywhere, a random key."""
    if own_seed is not None:
        text = f"{own_seed}" if child_index < 0 else f"{own_seed}__child#{child_index}"
    elif config_seed is not None:
        text = f"{config_seed}:{request_id}"
    else:
        return int.from_bytes(os.urandom(8), "little")
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _xorshift_(x: torch.Tensor, shift: int, scratch: torch.Tensor) -> torch.Tensor:
    return x.bitwise_xor_(torch.bitwise_right_shift(x, shift, out=scratch))


def mix32_(x: torch.Tensor) -> torch.Tensor:
    """The 32-bit mixer, in place, on an int64 tensor of values in [0, 2**32): a bijection with full avalanche.
    Both multipliers are below 2**31, so a product stays below 2**63 and masking it is an exact 32-bit multiply."""
    scratch = torch.empty_like(x)
    _xorshift_(x, S1, scratch).mul_(C1).bitwise_and_(M32)
    _xorshift_(x, S2, scratch).mul_(C2).bitwise_and_(M32)
    return _xorshift_(x, S3, scratch)


def absorb(word: torch.Tensor, state: torch.Tensor | int) -> torch.Tensor:
    """The sponge step: a 32-bit word mixed into a 32-bit state (the two broadcast), as a new tensor."""
    return mix32_((word ^ state).add_(GOLDEN).bitwise_and_(M32))


def noise_bits(keys: torch.Tensor, index: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, vocab] 32-bit hashes of (key, index, token id) for keys [N] (64-bit, as int64 two's complement) and
    token indices [N], on the keys' device: each row's state absorbs the key's halves and the index."""
    state = absorb(index & M32, absorb(keys & M32, absorb((keys >> 32) & M32, ROW_SALT)))
    codes = absorb(torch.arange(vocab, dtype=torch.int64, device=keys.device), VOCAB_SALT)
    return absorb(codes[None, :], state[:, None])


def uniform(bits: torch.Tensor) -> torch.Tensor:
    """float32 in (0, 1), never 0 or 1, from 32-bit hashes: (2m + 1) / 2**24 for m the top 23 bits."""
    return (bits >> (32 - U_BITS)).to(torch.float32).mul_(2).add_(1).mul_(2.0 ** -(U_BITS + 1))


def gumbel(keys: torch.Tensor, index: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, vocab] float32 Gumbel noise -log(-log(u)) for rows (keys [N], token indices [N])."""
    return uniform(noise_bits(keys, index, vocab)).log_().neg_().log_().neg_()


def signed64(key: int) -> int:
    """A 64-bit unsigned key as the int64 a torch tensor holds (two's complement)."""
    return key - (1 << 64) if key >= 1 << 63 else key
