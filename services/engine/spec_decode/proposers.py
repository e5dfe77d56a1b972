"""Builds the configured proposer (`--speculative-config`): the one place that knows every method.

Apart from the package's __init__ because the draft model needs a ModelRunner, and model_runner.py imports the
package's verify step.
"""

from __future__ import annotations

from pagedserve.services.engine.kv_cache_manager import KVCacheManager
from pagedserve.services.engine.model_runner import ModelRunner
from pagedserve.services.engine.models import load_model
from pagedserve.services.engine.spec_decode import Proposer, SpeculativeDecoding
from pagedserve.services.engine.spec_decode.draft_model import DraftModelProposer
from pagedserve.services.engine.spec_decode.eagle3 import Eagle3Proposer
from pagedserve.services.engine.spec_decode.eagle3_head import (
    FIELD,
    default_aux_layer_ids,
    load_eagle3_head,
    read_eagle3_config,
)
from pagedserve.services.engine.spec_decode.ngram import NgramProposer
from pagedserve.shared.config import Config, SpeculativeConfig
from pagedserve.shared.model_source import resolve_model_dir


def make_speculative_decoding(
    config: Config, target: ModelRunner, kv_cache: KVCacheManager
) -> SpeculativeDecoding | None:
    """The configured proposer, or None without `--speculative-config`; ValueError naming the field."""
    spec = config.runner.speculative
    if spec is None:
        return None
    proposer = make_proposer(spec, config, target, kv_cache)
    return SpeculativeDecoding(proposer, spec.num_speculative_tokens, target.max_model_len)


def make_proposer(spec: SpeculativeConfig, config: Config, target: ModelRunner, kv_cache: KVCacheManager) -> Proposer:
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "eagle3":
        if config.parallel.tensor_parallel_size > 1:  # the head would call the sharded embedding on rank 0 alone
            raise ValueError("speculative_config.method: eagle3 does not run with tensor parallelism yet")
        return make_eagle3_proposer(spec, target, kv_cache)
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


def make_eagle3_proposer(spec: SpeculativeConfig, target: ModelRunner, kv_cache: KVCacheManager) -> Eagle3Proposer:
    """Load the head, check it against the target, and make the target keep the head's aux hidden states."""
    assert spec.model is not None  # parse_speculative_config checked it
    model, target_spec = target.model, target.spec
    if not model.supports_aux_hidden_states:
        raise ValueError(f"{FIELD}: eagle3 needs a target whose forward keeps aux hidden states (Llama-like)")
    try:
        path = resolve_model_dir(spec.model)
    except Exception as exc:
        raise ValueError(f"{FIELD}: cannot find {spec.model!r} ({exc})") from None
    cfg = read_eagle3_config(path)
    if cfg.target_hidden_size != target_spec.hidden_size:
        raise ValueError(
            f"{FIELD}: the head fuses hidden states of size {cfg.target_hidden_size} (target_hidden_size), the "
            f"target's are {target_spec.hidden_size}"
        )
    if cfg.vocab_size != target_spec.vocab_size:
        raise ValueError(f"{FIELD}: the head's vocab_size {cfg.vocab_size} differs from the target's")
    head = load_eagle3_head(path, cfg, target_spec.dtype, target.device, target.max_model_len)
    if head.embed_tokens is None:  # most heads read the target's embeddings
        if cfg.hidden_size != target_spec.hidden_size:
            raise ValueError(f"{FIELD}: a head without embed_tokens needs the target's hidden size")
        head.embed_tokens = model.get_submodule("model.embed_tokens")
    num_layers = target_spec.num_layers
    layer_ids = cfg.aux_layer_ids or default_aux_layer_ids(num_layers)
    if len(set(layer_ids)) != 3 or not all(0 <= i < num_layers for i in layer_ids):
        raise ValueError(
            f"{FIELD}: eagle_aux_hidden_state_layer_ids {list(layer_ids)} must be 3 distinct layers of the "
            f"target's {num_layers}"
        )
    proposer = Eagle3Proposer(head, kv_cache, target.num_blocks, target.block_size, target.device, target_spec.dtype)
    model.aux_hidden_layers = frozenset(layer_ids)
    target.on_aux_hidden = proposer.take_hidden
    return proposer
