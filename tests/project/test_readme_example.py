"""The README's library example runs as written (with a small model and data in place of its
``...``) and follows the plugin's rules: the output head and the embedding on AdamW."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn as nn

README = Path(__file__).resolve().parents[2] / "README.md"


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(64, 32)
        self.layers = nn.ModuleList([nn.Linear(32, 32) for _ in range(2)])
        self.norm = nn.LayerNorm(32)
        self.output = nn.Linear(32, 64, bias=False)

    def forward(self, batch: torch.Tensor) -> SimpleNamespace:
        h = self.tok_embeddings(batch[:, :-1])
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        logits = self.output(self.norm(h))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        return SimpleNamespace(loss=loss)


def library_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    found = [b for b in blocks if "muon_param_groups(model" in b]
    assert len(found) == 1, "the README has one library example using muon_param_groups"
    return found[0]


def test_readme_library_example_runs_and_keeps_the_head_on_adamw() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    batch = torch.randint(0, 64, (8, 17))
    code = library_example().replace("model = ...", "")
    ns = {"model": model, "dataloader": [batch] * 20}
    before = model(batch).loss.item()
    exec(compile(code, str(README), "exec"), ns)
    assert model(batch).loss.item() < 0.95 * before
    groups: dict[str, set[str]] = {}
    for g in ns["optimizer"].param_groups:
        groups.setdefault(g["algorithm"], set()).update(g["param_names"])
    assert groups["muon"] == {"layers.0.weight", "layers.1.weight"}
    assert {"output.weight", "tok_embeddings.weight", "norm.weight"} <= groups["adamw"]
