"""``MuonLP``: ``MuonForeach`` with Muon momentum stored in bf16, int8, int4 or fp8.

The driver: it picks each Muon parameter's format (:mod:`muon_plugin.lp.formats`), creates its
state, hands the momenta to the functional core as :data:`~muon_plugin.lp.momentum.QUANTIZED`,
and converts loaded momentum (:mod:`muon_plugin.lp.checkpoint`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from muon_plugin.lp.checkpoint import restore
from muon_plugin.lp.codec import MomentumCodec
from muon_plugin.lp.formats import (
    CODECS,
    STATE_KEYS,
    choose_format,
    require_torchao,
    state_nbytes,
    validate_state_dtype,
)
from muon_plugin.lp.momentum import QUANTIZED, QuantizedMomentum
from muon_plugin.optimizer import MuonForeach
from muon_plugin.parameters import describe, local
from muon_plugin.state_layout import like_param

logger = logging.getLogger("muon_plugin.lp")


class MuonLP(MuonForeach):
    """``MuonForeach`` whose Muon momentum is stored in low precision.

    Takes every argument of :class:`~muon_plugin.MuonForeach`, plus:

    Args:
        state_dtype: ``"int8"`` (default), ``"int4"``, ``"fp8"`` (e4m3) or ``"bf16"``. int8 and
            fp8 use torchao's low-bit optimizer-state tensor types
            (``pip install 'muon_plugin[lp]'``); fp8 also keeps a bf16 rank-1 part ``u w^T``
            of each matrix's momentum (:mod:`muon_plugin.lp.rank1`), so its codes store only
            the smaller residual; int4 (a uniform mid-rise 16-level map, an
            8-bit log-scale code per block relative to a bf16 base per 16 blocks, see
            :mod:`muon_plugin.lp.int4`) and ``"bf16"`` need no torchao.
        block_size: elements per quantization scale (default: 256 for int8 / fp8, torchao's,
            and 16 for int4). Blocks (and int4's super-blocks of 16 blocks) run along the last
            dim and never cross a row; ignored for bf16.

    Each step, per Muon parameter: dequantize the local momentum to fp32, apply Muon's momentum
    update (``lerp`` towards the gradient, Nesterov look-ahead) in fp32, requantize the state in
    place, and hand the direction (fp32; bf16 from int8's fused kernel, the precision
    orthogonalization rounds every direction to) to the same plan as ``MuonForeach``.
    The first step is therefore identical to fp32-state Muon; later steps differ only through
    the quantization error of the stored momentum. Parameters of one group with the same format
    and local shape are updated as one stack (:mod:`muon_plugin.lp.momentum`: the same results
    as one at a time, with fewer kernels). fp8 adds one power-iteration step per
    matrix and step for its rank-1 part (two matrix-vector products; on a sharded parameter
    two small all-reduces over the mesh dims that shard it, once per stack). On CUDA with
    Triton, int8's update is one fused kernel (one pass over memory, torchao's math:
    :mod:`muon_plugin.kernels.quantized`; one launch for all of a step's int8 momenta, no
    stacks), allowed by the orthogonalization backend as the elementwise kernels are.
    Elsewhere ``compile=True`` compiles the update (one fused graph per stack size, two for
    fp8, whose power step runs between them); use it for speed there, since eager
    requantization runs torchao's ops as tens of small kernels per stack.

    Memory per Muon parameter element: int8 1 byte + 4 bytes per block (1.016 at 256), fp8 the
    same plus 2 bytes per row and per column (1.018 for 1024 x 4096), int4 0.5 + 1/16 + 2/256 =
    0.5703 at block 16, bf16 2 (fp32 Muon momentum: 4).

    Fallback: a parameter that cannot be blocked (fewer than 4096 elements, last dim not a
    multiple of ``block_size``, for int4 of ``16 * block_size`` = 256 by default, or last-dim
    sharding that would split a block or int4 super-block) keeps bf16 momentum; the optimizer
    logs one warning listing them.

    Checkpoints: the state is plain tensors (``momentum_codes`` + ``momentum_scales`` for int8,
    the same plus ``momentum_rank1_u`` / ``momentum_rank1_w`` for fp8 (laid out along the
    parameter's rows / columns); ``momentum_codes`` + ``momentum_scale_codes`` +
    ``momentum_scale_bases`` for int4; or a bf16 ``momentum_buffer``), DTensors laid out like
    their parameter, so ``state_dict()`` and
    DCP (``get_optimizer_state_dict`` / ``set_optimizer_state_dict``, flattened or not) work as
    for any optimizer, and loading on another layout (world size, FSDP vs. TP on the leading
    dims) moves whole blocks with their scales. ``load_state_dict`` also converts momentum saved
    in another format (another ``state_dtype`` or block size, or the fp32 ``momentum_buffer`` of
    ``Muon`` / ``MuonForeach``) by dequantizing and requantizing it. Through DCP the checkpoint
    must hold the same format, since DCP loads into this optimizer's own state tensors.

    AdamW / Adam groups keep full-precision state (fp32 ``exp_avg`` / ``exp_avg_sq`` and torch's
    fused or foreach kernels, exactly as in ``MuonForeach``): those groups hold embeddings,
    output heads, norms and biases, where low-bit Adam state is known to hurt stability
    (bitsandbytes keeps embeddings in 32-bit state for this reason), and where ``state_dtype``'s
    saving matters least. ``state_dtype`` applies to Muon momentum only.
    """

    def __init__(
        self,
        params: Any,
        *args: Any,
        state_dtype: str = "int8",
        block_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.state_dtype = state_dtype
        self.block_size = validate_state_dtype(state_dtype, block_size)
        if CODECS[state_dtype].needs_torchao:
            require_torchao(state_dtype)
        self._formats: dict[Tensor, MomentumCodec] = {}
        self._fallbacks: list[str] = []
        self._constructed = False
        super().__init__(params, *args, **kwargs)
        self._constructed = True
        self._report_fallbacks()

    # ------------------------------------------------------------------ formats

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["algorithm"] != "muon":
            return
        for i, p in enumerate(group["params"]):
            codec, why = choose_format(p, self.state_dtype, self.block_size)
            self._formats[p] = codec
            if why is not None:
                self._fallbacks.append(f"{describe(group, i, p)}: {why}")
        if self._constructed:
            self._report_fallbacks()

    def _report_fallbacks(self) -> None:
        if self._fallbacks:
            logger.warning(
                "MuonLP: %d parameter(s) cannot be quantized to %s (block_size %d) and keep "
                "bf16 momentum:\n  %s",
                len(self._fallbacks),
                self.state_dtype,
                self.block_size,
                "\n  ".join(self._fallbacks),
            )
        self._fallbacks = []

    def state_format(self, p: Tensor) -> MomentumCodec:
        """How the momentum of Muon parameter ``p`` is stored (its codec)."""
        codec = self._formats.get(p)
        if codec is None:
            raise KeyError("not a Muon parameter of this optimizer")
        return codec

    # ------------------------------------------------------------------ copies

    config_attributes = (*MuonForeach.config_attributes, "state_dtype", "block_size")

    def _rebuild_caches(self) -> None:
        super()._rebuild_caches()
        self._formats = {}
        self._fallbacks = []
        for group in self.param_groups:
            if group["algorithm"] == "muon":
                for p in group["params"]:
                    self._formats[p] = choose_format(p, self.state_dtype, self.block_size)[0]
        self._constructed = True

    # ------------------------------------------------------------------ step

    momentum_storage = QUANTIZED

    def _momentum_states(self, group: dict[str, Any], ps: list[Tensor]) -> list[Any]:
        """Each parameter's :class:`QuantizedMomentum` (its state created zero if missing)."""
        momenta = []
        for p in ps:
            codec = self.state_format(p)
            state = self.state[p]
            if any(k not in state for k in codec.keys):
                state.update(codec.zeros(p))
            local_state = {k: local(state[k]) for k in codec.keys}
            momenta.append(QuantizedMomentum(codec, local_state, p, group["compile"]))
        return momenta

    # ------------------------------------------------------------------ inspection

    @torch.no_grad()
    def momentum(self, p: Tensor) -> Tensor | None:
        """The dequantized fp32 momentum of ``p`` (a DTensor like ``p``), or None before a step."""
        codec = self.state_format(p)
        state = self.state.get(p, {})
        if any(k not in state for k in codec.keys):
            return None
        dense = codec.decode({k: local(state[k]) for k in codec.keys}, tuple(local(p).shape))
        return like_param(p, dense, tuple(p.shape))

    def state_bytes(self) -> tuple[int, int]:
        """``(bytes, elements)`` of this rank's Muon momentum state and local Muon parameters."""
        nbytes = numel = 0
        for p in self._formats:
            nbytes += state_nbytes(self.state.get(p, {}))
            numel += local(p).numel()
        return nbytes, numel

    # ------------------------------------------------------------------ checkpoints

    momentum_state_keys = STATE_KEYS

    def _restore_momentum(self, p: Tensor, saved: dict[str, Tensor]) -> dict[str, Tensor]:
        """Loaded momentum of ``p`` (any saved format) converted into this optimizer's format."""
        return restore(p, saved, self.state_format(p))
