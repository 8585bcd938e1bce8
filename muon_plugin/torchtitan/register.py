"""Make ``optimizer.name = "muon"`` work for every torchtitan train spec (idempotent).

torchtitan 0.2.2 reaches an optimizer through ``train_spec.build_optimizers_fn`` (``train.py``
calls ``torchtitan.protocols.train_spec.get_train_spec`` through the module attribute). The
model packages store either ``torchtitan.components.optimizer.build_optimizers`` (dense models)
or ``build_optimizers_with_moe_load_balancing`` (MoE models), which itself calls the module
global ``build_optimizers`` and then registers the expert-bias pre-step hook. :func:`install`

1. rebinds ``torchtitan.components.optimizer.build_optimizers`` to :func:`build_optimizers`, a
   dispatcher: ``"muon"`` goes to :func:`muon_plugin.torchtitan.builder.build_muon_optimizers`,
   any other name to the original builder. The MoE builder therefore builds Muon and keeps its
   load-balancing hook;
2. wraps ``get_train_spec`` so that specs holding the original ``build_optimizers`` get the
   dispatcher (MoE specs are left as they are; specs with another, custom builder get a wrapper
   that only intercepts ``"muon"``);
3. wraps torchtitan's ``MetricsProcessor`` to log the end-of-run summary and Muon's skipped
   updates (:mod:`muon_plugin.torchtitan.summary`);
4. wraps ``CheckpointManager.dcp_load`` to refuse, with a clear error, a checkpoint holding
   another optimizer's state (:mod:`muon_plugin.torchtitan.checkpoint`).

A ``None`` optimizer config (which torchtitan's own tests pass to custom builders) is never
Muon.

Code that imported ``build_optimizers`` or ``get_train_spec`` by value before this ran keeps
the originals.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

__all__ = ["build_optimizers", "install", "is_muon"]

_MARK = "_muon_plugin_hook"
_original_build_optimizers: Any = None


def is_muon(name: str) -> bool:
    return isinstance(name, str) and name.lower() == "muon"


def _wants_muon(optimizer_config: Any) -> bool:
    return is_muon(getattr(optimizer_config, "name", None))


def build_optimizers(
    model_parts: Any,
    optimizer_config: Any,
    parallel_dims: Any,
    ft_manager: Any = None,
) -> Any:
    """torchtitan's ``build_optimizers`` with ``optimizer.name = "muon"`` added."""
    if _wants_muon(optimizer_config):
        from muon_plugin.torchtitan.builder import build_muon_optimizers

        return build_muon_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)
    return _original_build_optimizers(
        model_parts=model_parts,
        optimizer_config=optimizer_config,
        parallel_dims=parallel_dims,
        ft_manager=ft_manager,
    )


setattr(build_optimizers, _MARK, True)


def _wrap_custom_builder(fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(model_parts, optimizer_config, parallel_dims, *args, **kwargs):
        if _wants_muon(optimizer_config):
            from torchtitan.tools.logging import logger

            from muon_plugin.torchtitan.builder import build_muon_optimizers

            logger.warning(
                f"optimizer.name = 'muon': the train spec's own optimizer builder "
                f"{getattr(fn, '__qualname__', fn)} is bypassed"
            )
            ft_manager = args[0] if args else kwargs.get("ft_manager")
            return build_muon_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)
        return fn(model_parts, optimizer_config, parallel_dims, *args, **kwargs)

    setattr(wrapper, _MARK, True)
    return wrapper


def with_muon(spec: Any) -> Any:
    """``spec`` whose ``build_optimizers_fn`` understands ``optimizer.name = "muon"``."""
    import torchtitan.components.optimizer as optim_module

    fn = spec.build_optimizers_fn
    if fn is None or getattr(fn, _MARK, False):
        return spec
    if fn is _original_build_optimizers:
        return dataclasses.replace(spec, build_optimizers_fn=build_optimizers)
    if fn is optim_module.build_optimizers_with_moe_load_balancing:
        return spec  # calls the module global build_optimizers: already dispatched
    return dataclasses.replace(spec, build_optimizers_fn=_wrap_custom_builder(fn))


def install() -> None:
    """Install the hooks; calling it again changes nothing."""
    global _original_build_optimizers
    import torchtitan.components.optimizer as optim_module
    import torchtitan.protocols as protocols
    import torchtitan.protocols.train_spec as train_spec_module

    current = optim_module.build_optimizers
    if not getattr(current, _MARK, False):
        _original_build_optimizers = current
        optim_module.build_optimizers = build_optimizers

    get_spec = train_spec_module.get_train_spec
    if not getattr(get_spec, _MARK, False):

        @functools.wraps(get_spec)
        def get_train_spec(name: str) -> Any:
            return with_muon(get_spec(name))

        setattr(get_train_spec, _MARK, True)
        train_spec_module.get_train_spec = get_train_spec
        if getattr(protocols, "get_train_spec", None) is get_spec:
            protocols.get_train_spec = get_train_spec

    from muon_plugin.torchtitan.checkpoint import install as install_checkpoint_check

    install_checkpoint_check()

    from muon_plugin.torchtitan.summary import install as install_summary

    install_summary()
