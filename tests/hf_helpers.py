"""Helpers shared by the layer and model tests: tiny configs, random weights and batches, comparisons."""

from __future__ import annotations

import random

import pytest
import torch

PAD = 1  # pad_token_id of every config below (RoBERTa's)


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """One intra-op thread for the module: with tensors this small, torch's thread pool only adds
    synchronisation, which on a shared 2-core machine turned 0.1 s runs into 5 s ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def hf_config(windows, hidden=32, heads=4, vocab=97, max_positions=64, **kwargs):
    """A tiny ``transformers.LongformerConfig``; ``windows`` are Hugging Face's TWO-SIDED windows."""
    import transformers

    return transformers.LongformerConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=len(windows),
        num_attention_heads=heads,
        intermediate_size=2 * hidden,
        attention_window=list(windows),
        max_position_embeddings=max_positions,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=PAD,
        type_vocab_size=2,
        **kwargs,
    )


def random_hf_windows(seed: int, layers: int) -> list[int]:
    """Per-layer two-sided windows that transformers accepts: it pads to a multiple of the largest
    and runs each layer's sliding chunks on that length, so every window must divide the largest
    (and be >= 4: a two-sided window of 2 crashes its chunking)."""
    rng = random.Random(seed)
    largest = rng.choice([8, 12])
    choices = [w for w in (4, 6, 8, 12) if largest % w == 0]
    windows = [rng.choice(choices) for _ in range(layers - 1)] + [largest]
    rng.shuffle(windows)
    return windows


def randomize_(model: torch.nn.Module, seed: int, std: float = 0.3) -> torch.nn.Module:
    """Weights far from the 0.02 init, so that attention is not near-uniform and errors show."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


def random_batch(seed: int, lengths: list[int], vocab: int, globals_per_example: list[int]):
    """Token ids padded to ``max(lengths)`` (pad id where padding), attention_mask and a
    global_attention_mask with the given number of globals at random real positions."""
    gen = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.randint(PAD + 2, vocab, (len(lengths), n), generator=gen)
    attention_mask = torch.zeros(len(lengths), n, dtype=torch.long)
    global_mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for b, (length, g) in enumerate(zip(lengths, globals_per_example, strict=True)):
        attention_mask[b, :length] = 1
        ids[b, length:] = PAD
        global_mask[b, torch.randperm(length, generator=gen)[:g]] = 1
    return ids, attention_mask, global_mask


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, what: str = ""):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    error = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    assert error <= atol, f"{what}: max error {error:.3e} > {atol:.1e}"
