#!/usr/bin/env bash
# Create ./.venv-titan03: muon_plugin with torchtitan 0.3.0 (the second release the plugin
# supports; ./.venv holds torchtitan 0.2.2). Same as `scripts/setup_env.sh --titan03`: the same
# torch choice (CPU build without an NVIDIA GPU), progress lines and stamp.
# MUON_PLUGIN_VENV_TITAN03 chooses another folder.
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh" --titan03
