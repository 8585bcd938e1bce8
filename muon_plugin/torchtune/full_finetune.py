"""torchtune 0.6.1's full-finetune recipe, with the optimizer built from named parameters.

Run it like a torchtune recipe (one process or many; CPU with gloo or GPUs)::

    tune run --nproc_per_node 2 muon_plugin/torchtune/full_finetune.py \\
        --config configs/torchtune_llama3_2_muon.yaml

``tune run`` turns the path into the module name ``muon_plugin.torchtune.full_finetune`` and
imports it, so the path works from any folder once muon_plugin is installed (a dotted name does
not: ``tune run`` cuts it at the last dot).

Everything is torchtune's ``FullFinetuneRecipeDistributed`` (FSDP2 over the ``dp`` mesh, TP
with ``tensor_parallel_plan``, gradient accumulation and clipping, LR schedulers, activation
checkpointing, the rank-0 full-state-dict checkpoints and, with ``enable_async_checkpointing``,
DCP), subclassed, except:

- the ``optimizer:`` component gets ``model.named_parameters()`` instead of
  ``model.parameters()``, so ``muon_plugin.torchtune.muon`` can apply its parameter classes;
- ``optimizer_in_bwd: true`` is refused before anything starts; a config error ends the run with
  one line from rank 0, ``config error: <key>: ...``;
- on ``device: cpu`` the recipe runs on gloo (:mod:`muon_plugin.torchtune.cpu_mode`);
- the DCP resume restores the LR scheduler's ``initial_lr`` (torchtune 0.6.1 drops it, for
  every optimizer, and the scheduler then refuses to resume);
- with ``optimizer.qk_clip_tau``, QK-Clip bounds every attention head's max logit after each
  optimizer step, and rank 0 logs what it clips with each logged step
  (:mod:`muon_plugin.torchtune.qk_clip`);
- a resume keeps the config's optimizer settings (lr included) and logs what changed
  (:func:`muon_plugin.torchtune.component.muon`); a checkpoint of another optimizer is refused
  by name (:mod:`muon_plugin.torchtune.resume`);
- rank 0 logs the end-of-run summary (:mod:`muon_plugin.torchtune.summary`).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, NoReturn

import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torch.optim import Optimizer
from torchtune import config, training, utils

from muon_plugin.adapter.qk_clip import QKClipRefused, attach_qk_clip, build_qk_clip
from muon_plugin.adapter.summary import RunSummary
from muon_plugin.torchtune.checks import check_recipe_config
from muon_plugin.torchtune.component import job_of
from muon_plugin.torchtune.cpu_mode import on_cpu, own_checkpoint_group
from muon_plugin.torchtune.options import SECTION, TorchtuneConfigError
from muon_plugin.torchtune.qk_clip import data_parallel_group, describe_attention
from muon_plugin.torchtune.resume import check_resumed_state
from muon_plugin.torchtune.summary import record_run
from muon_plugin.torchtune.upstream import load_recipe_module

FullFinetuneRecipeDistributed = load_recipe_module(
    "full_finetune_distributed"
).FullFinetuneRecipeDistributed

__all__ = ["MuonFullFinetuneRecipe", "recipe_main"]

log = utils.get_logger()


class MuonFullFinetuneRecipe(FullFinetuneRecipeDistributed):
    """``FullFinetuneRecipeDistributed`` whose optimizer component receives named parameters."""

    def __init__(self, cfg: DictConfig) -> None:
        check_recipe_config(cfg)  # before the process group starts
        with on_cpu(cfg.device):
            super().__init__(cfg)
        if self._enable_async_checkpointing:
            own_checkpoint_group(self._checkpoint_client, self._device)

    def _setup_model(self, *args: Any, **kwargs: Any) -> nn.Module:
        """The upstream model set-up (FSDP2 / TP, checkpoint load), runnable on CPUs."""
        with on_cpu(self._device):
            return super()._setup_model(*args, **kwargs)

    def setup(self, cfg: DictConfig) -> None:
        """The upstream set-up; then rank 0 starts recording the run for its summary."""
        super().setup(cfg)
        self._summary: RunSummary | None = None
        if self._is_rank_zero:
            job = job_of(self._optimizer)
            self._summary = record_run(
                self._metric_logger,
                self.world_size,
                self._output_dir,
                None if job is None else job.skipped_updates,
                None if job is None else job.qk_clip,
            )

    def train(self) -> None:
        """The upstream training loop, runnable on CPUs; rank 0 logs the run's summary."""
        try:
            with on_cpu(self._device):
                super().train()
        finally:
            summary = getattr(self, "_summary", None)
            if summary is not None:
                log.info(summary.format())

    def _setup_optimizer(
        self,
        cfg_optimizer: DictConfig,
        optimizer_in_bwd: bool = False,
        opt_state_dict: dict[str, Any] | None = None,
    ) -> Optimizer:
        """Build the optimizer from ``model.named_parameters()`` and restore its state.

        ``opt_state_dict``: the rank-0 full optimizer state dict of a resumed run, loaded
        (resharded to this run's layout) exactly as the upstream recipe does.
        """
        optimizer = config.instantiate(cfg_optimizer, list(self._model.named_parameters()))
        self._attach_qk_clip(optimizer)
        if self._resume_from_checkpoint:
            check_resumed_state(
                optimizer,
                opt_state_dict,
                self._dcp_folder() if self._enable_async_checkpointing else None,
                f"recipe_state.pt in {self._output_dir}",
            )
        if self._resume_from_checkpoint and self._enable_async_checkpointing:
            # The DCP resume loads into a template of this optimizer's state dict, and reads only
            # the keys it has: without ``initial_lr`` (which the LR scheduler adds later) the
            # scheduler cannot resume. The value is replaced by the checkpoint's.
            for group in optimizer.param_groups:
                group.setdefault("initial_lr", group["lr"])
        if opt_state_dict:
            training.load_from_full_optimizer_state_dict(
                self._model, optimizer, opt_state_dict, self._device
            )
        utils.log_rank_zero(log, "Optimizer is initialized.")
        return optimizer

    def _attach_qk_clip(self, optimizer: Optimizer) -> None:
        """With ``optimizer.qk_clip_tau``: QK-Clip over the model's attention modules, run
        after every optimizer step (:mod:`muon_plugin.torchtune.qk_clip`)."""
        job = job_of(optimizer)
        if job is None or job.config.qk_clip_tau is None:
            return
        try:
            job.qk_clip = build_qk_clip(
                [self._model],
                job.config,
                describe_attention,
                data_parallel_group(self._model),
                option=f"{SECTION}.qk_clip_tau",
            )
        except QKClipRefused as e:
            raise TorchtuneConfigError(str(e)) from None
        attach_qk_clip(job.qk_clip, optimizer.register_step_post_hook, log)

    def _dcp_folder(self) -> str | None:
        """The DCP folder the async resume loads (torchtune's own choice of the latest)."""
        try:
            checkpointer = self._checkpoint_client._get_dcp_checkpointer()
            return checkpointer._get_latest_intermediate_checkpoint()
        except Exception:  # no DCP folder: torchtune's own load reports it
            return None


def _config_error(error: TorchtuneConfigError) -> NoReturn:
    """End the process: rank 0 prints ``config error: <key>: ...`` (one line), others exit 1."""
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(f"config error: {error}" if os.environ.get("RANK", "0") == "0" else 1)


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: check, set up, train and clean up, as torchtune's recipe does."""
    try:
        check_recipe_config(cfg)
        config.log_config(recipe_name="MuonFullFinetuneRecipe", cfg=cfg)
        recipe = MuonFullFinetuneRecipe(cfg=cfg)
        recipe.setup(cfg=cfg)
    except TorchtuneConfigError as e:
        _config_error(e)
    recipe.train()
    gloo = dist.is_initialized() and dist.get_backend() == "gloo"
    recipe.cleanup()
    if gloo:
        leave_without_teardown()


def leave_without_teardown() -> NoReturn:
    """End a gloo run that has finished and cleaned up (checkpoints written, process group
    destroyed, loggers closed) without the interpreter's teardown: gloo's threads can make that
    teardown abort ("terminate called without an active exception", SIGABRT) on a loaded
    machine, which failed a run after the fact. Logging and the standard streams are flushed
    first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(recipe_main())
