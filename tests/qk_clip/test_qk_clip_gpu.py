"""QK-Clip's FlexAttention max-logit path on a GPU, against the exact chunked path.

Runs only with CUDA (``python -m pytest tests/qk_clip/test_qk_clip_gpu.py`` on a GPU machine): for
causal, windowed, packed-document, dense and ``BlockMask`` visibilities, GQA and MLA's 192-wide
heads, bf16 and fp32, sequence lengths that are and are not multiples of FlexAttention's block
size, the compiled FlexAttention forward's ``max_scores`` give the chunked path's maxima (fp32
products of the same inputs; the two differ by the order of the fp32 sums and FlexAttention's
log2 / ln 2 round trip: 1e-4 relative), and the path did run (it did not fall back) as a fused
kernel: torch's "called without torch.compile()" warning, what an unfused FlexAttention says,
fails the test. Each case starts from a reset compiler, so the five visibilities' compilations
stay under torch's recompile limit (past it the path takes the chunked fallback).
"""

from __future__ import annotations

import pytest
import torch

from muon_plugin.qk_clip import Visibility, max_logit_per_head

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def visibilities(b: int, seq: int, device) -> dict[str, Visibility]:
    from torch.nn.attention.flex_attention import create_block_mask

    docs = (torch.arange(seq, device=device) >= seq // 3).long().expand(b, seq).contiguous()
    docs[0] = (torch.arange(seq, device=device) >= seq // 2).long()
    same = (docs[:, :, None] == docs[:, None, :]) & torch.ones(
        seq, seq, dtype=torch.bool, device=device
    ).tril()

    def doc_causal(bb, h, i, j):
        return (j <= i) & (docs[bb, i] == docs[bb, j])

    bm = create_block_mask(doc_causal, b, None, seq, seq, device=device)
    return {
        "causal": Visibility(causal=True),
        "window": Visibility(causal=True, window=(100, 0)),
        "documents": Visibility(causal=True, documents=docs),
        "dense": Visibility(dense=same),
        "block_mask": Visibility(mask_mod=bm.mask_mod, mask_shape=(b, 1), block_mask=bm),
    }


ALL = ("causal", "window", "documents", "dense", "block_mask")
CASES = [  # (query heads, key heads, head dim, sequence, dtype, visibilities): every visibility
    # in bf16 at both head widths (GQA at 128, MLA's 192), each one in fp32 once; one compilation
    # per (visibility, case), so the suite compiles 15 times, not 40
    (8, 2, 128, 1024, torch.bfloat16, ALL),
    (4, 4, 192, 1000, torch.bfloat16, ALL),
    (8, 2, 128, 1000, torch.float32, ("causal", "documents")),
    (4, 4, 192, 1024, torch.float32, ("window", "dense", "block_mask")),
]


@pytest.mark.filterwarnings("error:flex_attention called without torch.compile")
@pytest.mark.parametrize(
    "heads,kv_heads,dim,seq,dtype,names",
    CASES,
    ids=["gqa-bf16", "mla-bf16", "gqa-fp32", "mla-fp32"],
)
def test_flex_path_matches_the_chunked_path(
    heads, kv_heads, dim, seq, dtype, names, monkeypatch
) -> None:
    import muon_plugin.qk_clip.logits as logits

    torch.compiler.reset()
    logits._flex_state.clear()
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    b = 2
    q = torch.randn(b, heads, seq, dim, device=device, generator=g).to(dtype) * 3
    k = torch.randn(b, kv_heads, seq, dim, device=device, generator=g).to(dtype) * 3
    flex_calls = []

    def counted(*args, **kwargs):
        out = flex_max(*args, **kwargs)
        flex_calls.append(out is not None)
        return out

    flex_max = logits._flex_max
    monkeypatch.setattr(logits, "_flex_max", counted)
    for name, vis in visibilities(b, seq, device).items():
        if name not in names:
            continue
        logits._flex_state.pop("failed", None)
        flex_calls.clear()
        flex = max_logit_per_head(q, k, scale=dim**-0.5, visible=vis)
        assert flex_calls == [True] and not logits._flex_state.get("failed"), name
        exact = max_logit_per_head(q, k, scale=dim**-0.5, visible=vis, flex=False)
        torch.testing.assert_close(flex, exact, rtol=1e-4, atol=1e-4, msg=name)
