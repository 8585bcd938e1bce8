"""The benchmark model ``llama3_bench``: ``--experimental.custom_import configs.llama3_bench_model``
(from the repository root, as ``scripts/train.sh`` runs it; it is benchmark code, not part of
the package).

Importing it registers a torchtitan train spec ``llama3_bench``: torchtitan's ``llama3`` with

- more flavors, sized for the local tokenizer of ``scripts/prepare_data.py`` (2048 tokens):
  ``bench_88m`` (GPT-2-small shape), ``bench_8b_4l`` (four Llama-3-8B layers: what
  ``scripts/bench_qk_clip.py`` and the QK-Clip throughput runs measure on one GPU) and
  ``bench_tiny`` (CPU smoke runs);
- a validator that evaluates the same held-out batches at every evaluation. torchtitan's own
  validator continues through its dataset from one evaluation to the next (and fails once the
  split is used up), so its curve mixes model progress with a changing sample.
"""

import dataclasses
from typing import Any

from torchtitan.models.llama3 import get_train_spec as llama3_train_spec
from torchtitan.models.llama3.model.args import TransformerModelArgs
from torchtitan.protocols.train_spec import register_train_spec

LOCAL_VOCAB = 2048
NAME = "llama3_bench"

FLAVORS = {
    # dim 768, 12 layers, 12 heads, FFN 2048: 88M parameters with the local vocabulary (85M in
    # the blocks, 3.1M in the embedding and the head).
    "bench_88m": TransformerModelArgs(
        dim=768, n_layers=12, n_heads=12, vocab_size=LOCAL_VOCAB, rope_theta=500000
    ),
    # Llama-3-8B's layers (dim 4096, 32 heads, 8 key heads, FFN 14336), 4 of them: 0.87B
    # parameters in the blocks.
    "bench_8b_4l": TransformerModelArgs(
        dim=4096,
        n_layers=4,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        vocab_size=LOCAL_VOCAB,
        rope_theta=500000,
    ),
    "bench_tiny": TransformerModelArgs(
        dim=256, n_layers=4, n_heads=8, vocab_size=LOCAL_VOCAB, rope_theta=500000
    ),
}


def _rewind(dataset: Any) -> None:
    """Put torchtitan's text dataset back at its first sample (its resume state)."""
    dataset._sample_idx = 0
    dataset._token_buffer = []


def build_fixed_validator(build: Any) -> Any:
    """``build`` (a validator builder) whose validators rewind their data before each pass."""

    def builder(*args: Any, **kwargs: Any) -> Any:
        validator = build(*args, **kwargs)
        dataset = validator.validation_dataloader.dataset
        validate = validator.validate

        def validate_from_start(model_parts: Any, step: int) -> None:
            _rewind(dataset)
            return validate(model_parts, step)

        validator.validate = validate_from_start
        return validator

    return builder


def _register() -> None:
    spec = llama3_train_spec()
    register_train_spec(
        NAME,
        dataclasses.replace(
            spec,
            model_args={**spec.model_args, **FLAVORS},
            build_validator_fn=build_fixed_validator(spec.build_validator_fn),
        ),
    )


_register()
