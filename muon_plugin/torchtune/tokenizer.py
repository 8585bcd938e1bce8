"""A local ``tokenizer.json`` as torchtune's text-completion tokenizer.

torchtune 0.6.1's ``HuggingFaceBaseTokenizer`` reads a Hugging Face ``tokenizer.json`` but has
no ``max_seq_len`` (which ``text_completion_dataset`` truncates to) and no ``pad_id`` (which the
full-finetune recipes pad batches with). :func:`text_tokenizer` adds both, so a recipe trains on
the project's local corpus and tokenizer (``scripts/prepare_data.py``: ``data/tokenizer/``)
without the hub. YAML::

    tokenizer:
      _component_: muon_plugin.torchtune.text_tokenizer
      path: data/tokenizer
      max_seq_len: 128
"""

from __future__ import annotations

from pathlib import Path

from torchtune.modules.transforms.tokenizers import HuggingFaceBaseTokenizer

__all__ = ["TextTokenizer", "text_tokenizer"]


class TextTokenizer(HuggingFaceBaseTokenizer):
    """``HuggingFaceBaseTokenizer`` with the ``max_seq_len`` and ``pad_id`` recipes read."""

    def __init__(
        self, tokenizer_json_path: str, tokenizer_config_json_path: str, max_seq_len: int | None
    ) -> None:
        super().__init__(tokenizer_json_path, tokenizer_config_json_path=tokenizer_config_json_path)
        if max_seq_len is not None and (
            isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 2
        ):
            raise ValueError(
                f"tokenizer.max_seq_len: invalid value {max_seq_len!r}; expected an integer >= 2"
            )
        self.max_seq_len = max_seq_len
        pad = self.config.get("pad_token") if self.config else None
        pad_id = self.tokenizer.token_to_id(pad) if isinstance(pad, str) else None
        self.pad_id = self.eos_id if pad_id is None else pad_id


def text_tokenizer(path: str, max_seq_len: int | None = None) -> TextTokenizer:
    """The tokenizer in folder ``path`` (``tokenizer.json`` and ``tokenizer_config.json``, the
    latter naming ``bos_token``, ``eos_token`` and optionally ``pad_token``; without a pad
    token batches are padded with EOS)."""
    folder = Path(path)
    files = [folder / "tokenizer.json", folder / "tokenizer_config.json"]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(
                f"tokenizer.path: {str(folder)!r} has no {f.name} (build one with "
                "scripts/prepare_data.py --out DIR: DIR/tokenizer)"
            )
    return TextTokenizer(str(files[0]), str(files[1]), max_seq_len)
