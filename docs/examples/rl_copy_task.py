"""The copy task of docs/examples/rl_loop.py: a prompt is BOS, K random content tokens and SEP; the right answer
is the same K tokens (then EOS). The reward of one sample is the share of its first K tokens that match.

`make_policy` writes the starting policy: a tiny Llama (transformers' own class, `save_pretrained`) trained by
plain supervised steps on the task for a few seconds, so it copies some tokens but far from all, and reinforcement
learning has something to improve. Every output depends on every prompt position, so a serving bug that drops or
shifts a position shows up as lost reward."""

from __future__ import annotations

import random
from pathlib import Path

import torch

BOS, EOS, SEP = 1, 2, 3
FIRST_CONTENT = 4  # content tokens are FIRST_CONTENT .. vocab_size - 1
VOCAB = 32
K = 6  # content tokens a prompt


def make_prompts(rng: random.Random, count: int, k: int = K) -> list[list[int]]:
    """`count` prompts [BOS, c_1 .. c_k, SEP]."""
    return [[BOS] + [rng.randrange(FIRST_CONTENT, VOCAB) for _ in range(k)] + [SEP] for _ in range(count)]


def answer_of(prompt: list[int]) -> list[int]:
    """The tokens a perfect policy writes after `prompt`."""
    return prompt[1:-1]


def matches(prompt: list[int], sample: list[int]) -> list[int]:
    """Per answer position, 1 where `sample` has the answer's token there, else 0."""
    want = answer_of(prompt)
    return [int(i < len(sample) and sample[i] == w) for i, w in enumerate(want)]


def reward(prompt: list[int], sample: list[int]) -> float:
    """The share of the answer's tokens that `sample` has at the same positions (0.0 .. 1.0)."""
    return sum(matches(prompt, sample)) / K


def policy_config():
    from transformers import LlamaConfig

    # 4 query and 2 key/value heads: both split over TP=2
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                       bos_token_id=BOS, eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=False,
                       rms_norm_eps=1e-6)


def supervised_step(model, optimizer, rng: random.Random, batch: int) -> float:
    """One teacher-forced step on fresh prompts: cross-entropy of the answer tokens only."""
    prompts = make_prompts(rng, batch)
    seqs = torch.tensor([p + answer_of(p) + [EOS] for p in prompts])
    logits = model(seqs[:, :-1]).logits
    start = len(prompts[0]) - 1  # the position whose next token is the answer's first
    loss = torch.nn.functional.cross_entropy(logits[:, start:].reshape(-1, VOCAB), seqs[:, start + 1:].reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def make_policy(out_dir: Path, steps: int = 60, seed: int = 0, batch: int = 64, lr: float = 3e-3) -> Path:
    """Train the starting policy for `steps` supervised steps and save it (with a generation config) to out_dir."""
    from transformers import GenerationConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = LlamaForCausalLM(policy_config()).to(torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        supervised_step(model, optimizer, rng, batch)
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=0,
                                               do_sample=False, max_new_tokens=K)
    out_dir = Path(out_dir)
    model.eval().save_pretrained(out_dir)
    return out_dir


def mean_reward(model, prompts: list[list[int]]) -> float:
    """The greedy policy's mean reward (transformers' generate): how well the model copies now."""
    with torch.no_grad():
        out = model.generate(torch.tensor(prompts), max_new_tokens=K, do_sample=False, eos_token_id=None)
    return sum(reward(p, o[len(p):].tolist()) for p, o in zip(prompts, out)) / len(prompts)
