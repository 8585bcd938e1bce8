"""The framework adapter core: what every front end (torchtitan 0.2.2, torchtitan 0.3,
TorchTune, plain PyTorch) shares, so that each framework's layer only translates its own
configuration and wires these pieces into its own hooks.

- :mod:`.job`: build one Muon optimizer per model part from the options and the class rules
  (:class:`JobOptimizers`), the rule table, the plan report, the build log;
- :mod:`.resume`: on a resume, the job's group settings win over the checkpoint's, and what
  changed is logged (:func:`keep_job_settings_on_load`);
- :mod:`.foreign_state`: a checkpoint holding another optimizer's state is refused with an error
  naming the parameter and the state names;
- :mod:`.summary`: the end-of-run summary (:class:`RunSummary`).

Nothing here imports a training framework.
"""

from muon_plugin.adapter.job import JobOptimizers, build_job_optimizers, is_rank0
from muon_plugin.adapter.resume import keep_job_settings_on_load
from muon_plugin.adapter.summary import RunSummary

__all__ = [
    "JobOptimizers",
    "RunSummary",
    "build_job_optimizers",
    "is_rank0",
    "keep_job_settings_on_load",
]
