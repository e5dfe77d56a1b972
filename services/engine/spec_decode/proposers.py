"""Builds the configured proposer (`--speculative-config`): the one place that knows every method.

Apart from the package's __init__ because the draft model needs a ModelRunner, and model_runner.py imports the
package's verify step.
"""

from __future__ import annotations

from pagedserve.services.engine.model_runner import ModelRunner
from pagedserve.services.engine.models import load_model
from pagedserve.services.engine.spec_decode import Proposer, SpeculativeDecoding
from pagedserve.services.engine.spec_decode.draft_model import DraftModelProposer
from pagedserve.services.engine.spec_decode.ngram import NgramProposer
from pagedserve.shared.config import Config, SpeculativeConfig
from pagedserve.shared.model_source import resolve_model_dir


def make_speculative_decoding(config: Config, target: ModelRunner) -> SpeculativeDecoding | None:
    """The configured proposer, or None without `--speculative-config`; ValueError naming the field."""
    spec = config.runner.speculative
    if spec is None:
        return None
    return SpeculativeDecoding(make_proposer(spec, config, target), spec.num_speculative_tokens, target.max_model_len)


def make_proposer(spec: SpeculativeConfig, config: Config, target: ModelRunner) -> Proposer:
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    assert spec.model is not None  # parse_speculative_config checked it
    try:
        path = resolve_model_dir(spec.model)
        model = load_model(path, target.spec.dtype, target.device, show_progress=False)
    except Exception as exc:  # a missing directory, a family we cannot load: either way start-up stops here
        raise ValueError(f"speculative_config.model: cannot load {spec.model!r} ({exc})") from None
    if model.spec.vocab_size != target.spec.vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft's vocabulary ({model.spec.vocab_size}) differs from the "
            f"target's ({target.spec.vocab_size}); a draft model must share the tokenizer"
        )
    return DraftModelProposer.build(model, target, config.scheduler.max_num_batched_tokens)
