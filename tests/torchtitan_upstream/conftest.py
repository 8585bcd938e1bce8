"""torchtitan 0.2.2's own unit tests run with muon_plugin's torchtitan plugin imported."""

import pytest

pytest.importorskip("torchtitan")

import muon_plugin.torchtitan  # noqa: E402,F401  (installs the hooks, as job.custom_config_module does)
