"""The codec interface: how one parameter's Muon momentum is stored, read, updated and laid out.

A codec (one class per format: :mod:`~muon_plugin.lp.bf16`, :mod:`~muon_plugin.lp.int8`,
:mod:`~muon_plugin.lp.int4`, :mod:`~muon_plugin.lp.fp8`) names the state tensors of a parameter's
momentum (its ``keys``), their shapes and dtypes (``layout``), their DTensor placements
(``placements``), and decodes, encodes and updates them. Quantization blocks are
``block_size`` consecutive elements of one row (along the last dim; int4's super-blocks are 16
blocks) and never cross a row. The state tensors are plain tensors, or DTensors on the
parameter's mesh, so:

- the optimizer state is plain tensors: ``state_dict()``, ``torch.save``, ``copy.deepcopy`` and
  ``torch.distributed.checkpoint`` (DCP) handle it like any other optimizer state;
- a DCP checkpoint reshards like the parameter: any layout that splits rows at block (int4:
  super-block) boundaries, i.e. every sharding of the leading dims (FSDP2, HSDP, EP, colwise TP)
  and last-dim sharding into multiples of the block, owns whole blocks with their scales, so
  saving on one layout and loading on another moves codes and scales and never re-blocks.

Every update is Muon's momentum step in fp32 on the decoded state: ``buf <- lerp(buf, grad,
1 - momentum)``, requantized in place; the direction is the Nesterov look-ahead ``lerp(grad,
buf, momentum)`` or ``buf`` itself, so quantization error enters only through the stored state.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Placement, Shard

from muon_plugin.lp.keys import CODES_KEY
from muon_plugin.lp.runtime import run
from muon_plugin.parameters import local
from muon_plugin.state_layout import like_param

MIN_QUANTIZED_NUMEL = 4096
"""Like torchao's (and bitsandbytes') optimizers: smaller tensors are not worth quantizing."""

Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]
"""Shape and dtype of each state tensor."""


@dataclass(frozen=True)
class MomentumStep:
    """The settings of one momentum update (the same for every parameter of a stack)."""

    momentum: float
    nesterov: bool
    compiled: bool = False
    """Run the update function under ``torch.compile``."""
    param: Tensor | None = None
    """The parameter (a DTensor when sharded): which dims are sharded, for a format whose
    update communicates."""
    stacked: bool = False
    """The state and grad carry a leading dim of same-shape parameters."""
    kernels: bool | None = None
    """Whether a format's fused Triton kernel may run (the orthogonalization backend's call;
    None: ``MUON_PLUGIN_DISABLE_TRITON`` decides)."""


@dataclass(frozen=True)
class MomentumCodec(ABC):
    """One momentum format at one block size (0 where it has no blocks)."""

    block_size: int = 0

    kind: ClassVar[str]
    """The ``state_dtype`` that selects it."""
    keys: ClassVar[tuple[str, ...]]
    """Its state keys (:mod:`muon_plugin.lp.keys`)."""
    scales_key: ClassVar[str | None] = None
    """The key holding one entry per block (None: no blocks)."""
    quantized: ClassVar[bool] = True
    default_block_size: ClassVar[int] = 0
    needs_torchao: ClassVar[bool] = False
    fresh: ClassVar[Mapping[str, float]] = {}
    """Values of a zero momentum's state tensors other than 0."""

    # ------------------------------------------------------------------ configuration

    @classmethod
    def check_block_size(cls, size: int) -> None:
        """Raise ValueError if this format cannot use blocks of ``size`` elements (any positive
        size, unless a format says otherwise)."""
        return None

    @property
    def unit(self) -> int:
        """Elements of a row stored together (a block): a row, and each shard of a sharded
        row, must be a multiple of it."""
        return self.block_size

    def unit_name(self) -> str:
        """:attr:`unit` in words, for the fallback message."""
        return f"block_size {self.block_size}"

    def fallback_reason(self, p: Tensor) -> str | None:
        """Why ``p`` cannot take this format (None: it can). Depends only on the global shape
        and placements, so every rank agrees."""
        numel = p.numel()
        if numel < MIN_QUANTIZED_NUMEL:
            return f"{numel} elements < {MIN_QUANTIZED_NUMEL}"
        cols, shards = p.shape[-1], 1
        if isinstance(p, DTensor):
            for mesh_dim, placement in enumerate(p.placements):
                dim = getattr(placement, "dim", None)
                if dim is None or dim % p.ndim != p.ndim - 1:
                    continue
                if type(placement) is not Shard:
                    return f"last dim sharded as {placement}"
                shards *= p.device_mesh.size(mesh_dim)
        if cols % (self.unit * shards):
            across = f" x {shards} shards of the last dim" if shards > 1 else ""
            return f"last dim {cols} not divisible by {self.unit_name()}{across}"
        return None

    # ------------------------------------------------------------------ layout

    @abstractmethod
    def layout(self, shape: tuple[int, ...]) -> Layout:
        """Shape and dtype of each state tensor for a parameter (or shard) of ``shape``."""

    def placements(self, p: DTensor, key: str) -> tuple[Placement, ...]:
        """Placements of state tensor ``key`` of DTensor parameter ``p``: ``p``'s own."""
        return tuple(p.placements)

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of the state of a parameter (or shard) of ``shape``."""
        return sum(math.prod(s) * dtype.itemsize for s, dtype in self.layout(shape).values())

    def bytes_per_element(self, shape: tuple[int, ...]) -> float:
        """State bytes per parameter element, for a parameter of ``shape``."""
        return self.nbytes(shape) / math.prod(shape)

    def zeros(self, p: Tensor) -> dict[str, Tensor]:
        """Zero momentum for ``p``: plain tensors, or DTensors laid out like ``p``'s state."""
        lp = local(p)
        local_layout = self.layout(tuple(lp.shape))
        global_layout = self.layout(tuple(p.shape))
        out = {}
        for key, (shape, dtype) in local_layout.items():
            t = torch.full(shape, self.fresh.get(key, 0.0), dtype=dtype, device=lp.device)
            placements = self.placements(p, key) if isinstance(p, DTensor) else None
            out[key] = like_param(p, t, global_layout[key][0], placements)
        return out

    @classmethod
    def from_saved(
        cls, shape: tuple[int, ...], saved: Mapping[str, Tensor]
    ) -> MomentumCodec | None:
        """This format at the block size the saved entries of a parameter of global ``shape``
        were written with, if they hold exactly its keys' shapes and dtypes (else None)."""
        if cls.scales_key is None or any(k not in saved for k in cls.keys):
            return None
        per_block = saved[cls.scales_key]
        blocks = per_block.shape[-1] if per_block.ndim else 0
        if not blocks or shape[-1] % blocks:
            return None
        codec = cls(shape[-1] // blocks)
        layout = codec.layout(shape)
        if shape[-1] % codec.unit or any(
            (tuple(saved[k].shape), saved[k].dtype) != layout[k] for k in cls.keys
        ):
            return None
        return codec

    # ------------------------------------------------------------------ math (local state)

    @abstractmethod
    def decode(self, state: Mapping[str, Tensor], shape: tuple[int, ...]) -> Tensor:
        """The local momentum in fp32, shaped ``shape`` (the local parameter shape)."""

    @abstractmethod
    def encode_(self, state: Mapping[str, Tensor], dense: Tensor) -> None:
        """Store ``dense`` (fp32, the local parameter shape) into the local state."""

    communicates: ClassVar[bool] = False
    """Whether its update runs collectives (then an empty local shard still takes part)."""

    def update_(
        self,
        state: Mapping[str, Tensor],
        grad: Tensor,
        momentum: float,
        nesterov: bool,
        compiled: bool = False,
        param: Tensor | None = None,
        stacked: bool = False,
        kernels: bool | None = None,
    ) -> Tensor:
        """Muon's momentum step on the local state, in place; the fp32 direction (grad's shape).

        The keyword settings are :class:`MomentumStep`'s. An empty local shard has nothing to
        update: its direction is empty (formats that communicate still join their
        collectives).
        """
        if grad.numel() == 0 and not self.communicates:
            return torch.zeros(grad.shape, dtype=torch.float32, device=grad.device)
        step = MomentumStep(momentum, nesterov, compiled, param, stacked, kernels)
        return self._update(state, grad, step)

    @abstractmethod
    def _update(self, state: Mapping[str, Tensor], grad: Tensor, step: MomentumStep) -> Tensor:
        """:meth:`update_` of this format (``grad`` has elements unless it communicates)."""

    def fused_applies(
        self, state: Mapping[str, Tensor], grad: Tensor, kernels: bool | None
    ) -> bool:
        """Whether this format's fused kernel takes this local state and grad
        (:meth:`fused_update_`; ``kernels`` as in :class:`MomentumStep`). None has one by
        default."""
        return False

    def fused_update_(
        self,
        states: Sequence[Mapping[str, Tensor]],
        grads: Sequence[Tensor],
        momentum: float,
        nesterov: bool,
        direction_dtype: torch.dtype = torch.bfloat16,
    ) -> list[Tensor]:
        """:meth:`update_` for momenta of any shapes that :meth:`fused_applies` takes (one
        device, one grad dtype), in one launch; the directions in ``direction_dtype`` (bf16:
        what orthogonalization rounds them to anyway). If the kernel fails to build or launch
        (it warns once, then :meth:`fused_applies` says no), the torch ops give the same."""
        out = self._fused_launch(states, grads, momentum, nesterov, direction_dtype)
        if out is None:
            out = [
                self.update_(state, grad, momentum, nesterov, kernels=False).to(direction_dtype)
                for state, grad in zip(states, grads, strict=True)
            ]
        return out

    def _fused_launch(
        self,
        states: Sequence[Mapping[str, Tensor]],
        grads: Sequence[Tensor],
        momentum: float,
        nesterov: bool,
        direction_dtype: torch.dtype,
    ) -> list[Tensor] | None:
        """This format's fused kernel on the lists (None: it failed, nothing was updated)."""
        raise NotImplementedError(f"{type(self).__name__} has no fused kernel")

    def update_batch_(
        self,
        states: Sequence[Mapping[str, Tensor]],
        grads: Sequence[Tensor],
        momentum: float,
        nesterov: bool,
        compiled: bool = False,
        param: Tensor | None = None,
        kernels: bool | None = None,
    ) -> list[Tensor]:
        """:meth:`update_` for same-shape parameters at once: their states and gradients are
        stacked, updated by one sequence of kernels, and copied back; each result equals the
        parameter's own :meth:`update_` bit for bit. ``param``: any one of the parameters (all
        laid out alike)."""
        stacked = {k: torch.stack([s[k] for s in states]) for k in self.keys}
        directions = self.update_(
            stacked,
            torch.stack(list(grads)),
            momentum,
            nesterov,
            compiled,
            param,
            stacked=True,
            kernels=kernels,
        )
        for key in self.keys:
            torch._foreach_copy_([s[key] for s in states], list(stacked[key].unbind()))
        return list(directions.unbind())


class ViewedCodec(MomentumCodec):
    """A codec whose local codes and scales are seen as one quantized tensor (:meth:`view`,
    a torchao optimizer-state tensor or :class:`~muon_plugin.lp.int4.Int4State`) that
    dequantizes and is copied into."""

    codes_key: ClassVar[str] = CODES_KEY
    """The key of the codes (an empty local shard has no codes to view)."""
    update_fn: ClassVar[Callable[..., Tensor]]
    """``(*operands, grad, momentum, nesterov) -> direction``, updating the operands in place
    (eager, or compiled by :func:`~muon_plugin.lp.runtime.run`)."""

    @abstractmethod
    def view(self, state: Mapping[str, Tensor]) -> Any:
        """The local state as one quantized 1-D tensor sharing its storage."""

    def operands(self, state: Mapping[str, Tensor]) -> tuple[Any, ...]:
        """What :attr:`update_fn` updates: the :meth:`view` of the state."""
        return (self.view(state),)

    def _update(self, state: Mapping[str, Tensor], grad: Tensor, step: MomentumStep) -> Tensor:
        """The format's fused Triton kernel where it applies (one pass, the same math), else
        :attr:`update_fn`, eager or compiled; the direction in fp32 either way."""
        if self.fused_applies(state, grad, step.kernels):
            directions = self.fused_update_(
                [state], [grad], step.momentum, step.nesterov, torch.float32
            )
            return directions[0]
        flat = grad.reshape(-1)
        operands = self.operands(state)
        fn, compiled = self.update_fn, step.compiled
        return run(fn, compiled, *operands, flat, step.momentum, step.nesterov).view(grad.shape)

    def decode(self, state: Mapping[str, Tensor], shape: tuple[int, ...]) -> Tensor:
        codes = state[self.codes_key]
        if codes.numel() == 0:
            return torch.zeros(shape, dtype=torch.float32, device=codes.device)
        return self.view(state).dequantize().view(shape)

    def encode_(self, state: Mapping[str, Tensor], dense: Tensor) -> None:
        if dense.numel():
            self.view(state).copy_(dense.reshape(-1))
