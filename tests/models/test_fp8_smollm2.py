"""FP8 weights on the real SmolLM2-135M-Instruct: the logprob error against HF fp32, beside bf16's own.

Random-weight shapes (bench/throughput.py) cannot tell a quantisation bug from the noise of a model
whose logits are nearly flat, so this pins the error on real weights and real text: teacher-forced
logprobs of the actual next tokens of chat transcripts (prompt and answer), HF fp32 as the reference.

Measured here (torch 2.13 CPU): ours bf16 mean |err| ~0.02, HF bf16 the same; ours fp8 ~5x that, mean
KL(fp32 || fp8) ~0.03 nats. e4m3 keeps 4 fewer mantissa bits than bf16 (16x the rounding step), and
SmolLM2's down_proj inputs reach ~3e3 (a per-token scale then leaves the ordinary channels a few
e4m3 steps), so ~5x is the expected size; a wrong scale axis, a missing scale or an unscaled
activation gives errors of whole nats.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedserve.services.engine.models import load_model
from pagedserve.shared.model_source import resolve_model_dir
from tests.models.paged_driver import PagedDriver

pytestmark = pytest.mark.usefixtures("one_thread")
CHATS = [
    ("What is the capital of France?", "The capital of France is Paris, a city known for the Eiffel Tower."),
    ("Write a haiku about the sea.", "Waves fold into foam,\nsalt wind carries gull voices,\nthe tide keeps its time."),
    ("Give me three prime numbers above 100.", "Sure: 101, 103 and 107 are all prime numbers above 100."),
]


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model_dir(None)


@pytest.fixture(scope="module")
def sequences(model_dir) -> list[tuple[list[int], int]]:
    """(token ids of the whole transcript, where the answer starts)."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for question, answer in CHATS:
        user = {"role": "user", "content": question}
        texts = (
            tok.apply_chat_template([user], add_generation_prompt=True, tokenize=False),
            tok.apply_chat_template([user, {"role": "assistant", "content": answer}], tokenize=False),
        )
        prompt, full = (tok.encode(str(text), add_special_tokens=False) for text in texts)
        assert full[: len(prompt)] == prompt
        out.append((full, len(prompt)))
    return out


def _logprobs(logits: list[torch.Tensor], sequences: list[tuple[list[int], int]]) -> list[torch.Tensor]:
    """Per sequence: log-softmax over the vocabulary at every answer position [n_answer, vocab]."""
    return [lg[start - 1 : -1].float().log_softmax(-1) for lg, (_, start) in zip(logits, sequences)]


def _errors(got: list[torch.Tensor], want: list[torch.Tensor], sequences) -> dict[str, float]:
    tokens = [torch.tensor(ids[start:])[:, None] for ids, start in sequences]
    token_err = torch.cat([(g.gather(1, t) - w.gather(1, t)).abs()[:, 0] for g, w, t in zip(got, want, tokens)])
    kl = torch.cat([(w.exp() * (w - g)).sum(-1) for g, w in zip(got, want)])
    return {"mean": float(token_err.mean()), "max": float(token_err.max()), "kl": float(kl.mean())}


@pytest.fixture(scope="module")
def reference(model_dir, sequences) -> list[torch.Tensor]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.inference_mode():
        return _logprobs([hf(torch.tensor([ids])).logits[0] for ids, _ in sequences], sequences)


def _ours(model_dir, sequences, **kwargs) -> list[torch.Tensor]:
    model = load_model(model_dir, device="cpu", show_progress=False, **kwargs)
    logits = PagedDriver(model, num_blocks=64, block_size=16).step({i: ids for i, (ids, _) in enumerate(sequences)})
    return _logprobs(logits, sequences)


def test_fp8_logprob_error_on_real_weights_is_a_few_times_bf16s(model_dir, sequences, reference) -> None:
    bf16 = _errors(_ours(model_dir, sequences, dtype="bf16"), reference, sequences)
    fp8 = _errors(_ours(model_dir, sequences, dtype="bf16", quantization="fp8"), reference, sequences)
    print(f"logprob error vs HF fp32: bf16 {bf16}, fp8 {fp8}")
    assert bf16["mean"] < 0.05 and bf16["kl"] < 0.005, bf16  # sanity: the reference and the driver agree
    assert fp8["mean"] < 10 * max(bf16["mean"], 0.01) and fp8["mean"] < 0.3, (fp8, bf16)
    assert fp8["kl"] < 0.08 and fp8["max"] < 3.0, fp8
