"""Per-sequence log-probabilities: from logits, and through a model's chunked output projection, which must agree."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from foundry.models.mpt import MPTCausalLM
from foundry.preference.logps import model_sequence_logps, sequence_logps


def test_sequence_logps_sum_the_log_softmax_of_each_labelled_next_token() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=generator)
    labels = torch.tensor([[-100, -100, 3, 4, 5], [-100, 1, 2, -100, -100]])
    summed, tokens = sequence_logps(logits, labels)
    log_probs = logits.log_softmax(-1)
    expected = [
        sum(log_probs[row, t - 1, labels[row, t]].item() for t in range(1, 5) if labels[row, t] != -100)
        for row in range(2)
    ]
    assert summed[:, 0].tolist() == pytest.approx(expected, rel=1e-6)
    assert tokens.tolist() == [[3], [2]]


def test_packed_sequences_sum_separately_and_as_each_alone() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 8, 7, generator=generator)
    labels = torch.tensor([[-100, 1, 2, -100, -100, 3, 4, -100]])  # two sequences, then padding
    sequence_id = torch.tensor([[0, 0, 0, 1, 1, 1, 1, -1]])
    summed, tokens = sequence_logps(logits, labels, sequence_id)
    first, _ = sequence_logps(logits[:, :3], labels[:, :3])
    second, _ = sequence_logps(logits[:, 3:7], labels[:, 3:7])
    assert summed[0].tolist() == pytest.approx([first.item(), second.item()], rel=1e-6)
    assert tokens.tolist() == [[2, 2]]


def tiny_mpt(**keys: object) -> MPTCausalLM:
    torch.manual_seed(0)
    return MPTCausalLM(
        d_model=16, n_heads=2, n_layers=2, max_seq_len=16, vocab_size=61, no_bias=True, learned_pos_emb=False,
        attn_config={"alibi": True, "attn_uses_sequence_id": True}, **keys,
    )  # fmt: skip


def rows_of_pairs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 61, (4, 12), generator=generator)
    labels = input_ids.clone()
    labels[:, :5] = -100  # the prompt
    labels[2, 9:] = -100  # padding
    return input_ids, labels


@pytest.mark.parametrize("logit_scale", [None, 0.5])
def test_chunked_log_probs_and_their_gradients_equal_those_from_the_logits(logit_scale: float | None) -> None:
    model = tiny_mpt(logit_scale=logit_scale)
    input_ids, labels = rows_of_pairs()
    chunked, tokens = model_sequence_logps(model, {"input_ids": input_ids}, labels)
    upstream = torch.tensor([[0.3], [-1.2], [0.7], [2.0]])  # DPO's gradients differ pair by pair
    chunked_grads = torch.autograd.grad((chunked * upstream).sum(), list(model.parameters()))
    from_logits, expected_tokens = sequence_logps(model({"input_ids": input_ids}), labels)
    expected_grads = torch.autograd.grad((from_logits * upstream).sum(), list(model.parameters()))
    torch.testing.assert_close(chunked, from_logits, rtol=1e-6, atol=1e-5)
    assert tokens.tolist() == expected_tokens.tolist() == [[7], [7], [4], [7]]
    for got, want in zip(chunked_grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=5e-6)


def test_chunked_log_probs_of_packed_sequences_equal_those_from_the_logits() -> None:
    model = tiny_mpt()
    input_ids, labels = rows_of_pairs()
    sequence_id = torch.tensor([[0] * 6 + [1] * 6] * 4)
    labels[:, 6:8] = -100  # the second sequence's prompt
    inputs = {"input_ids": input_ids, "sequence_id": sequence_id}
    chunked, tokens = model_sequence_logps(model, inputs, labels, sequence_id)
    from_logits, expected_tokens = sequence_logps(model(inputs), labels, sequence_id)
    torch.testing.assert_close(chunked, from_logits, rtol=1e-6, atol=1e-5)
    assert tokens.tolist() == expected_tokens.tolist()


class _WidestVocabTensor(TorchDispatchMode):
    """Records the most elements of any tensor an op returns whose last dimension is the vocabulary."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.most_elements = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.dim() and tensor.shape[-1] == self.vocab:
                self.most_elements = max(self.most_elements, tensor.numel())
        return out


def test_the_chunked_path_never_builds_the_whole_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_mpt()
    input_ids, labels = rows_of_pairs()
    tokens, vocab = input_ids.numel(), model.config.vocab_size
    monkeypatch.setattr("foundry.kernels.linear_cross_entropy.CHUNK_LOGITS_BYTES", tokens // 4 * vocab * 4)  # fp32
    with _WidestVocabTensor(vocab) as chunked:
        logps, _ = model_sequence_logps(model, {"input_ids": input_ids}, labels)
        logps.sum().backward()
    with _WidestVocabTensor(vocab) as from_logits:
        model({"input_ids": input_ids})
    assert from_logits.most_elements == tokens * vocab
    assert chunked.most_elements < tokens * vocab  # chunks' logits (forward, and again in the backward)
