#!/usr/bin/env bash
# Open the book in JupyterLab: `bash scripts/lab.sh [jupyter lab options]`, after `pip install -e ".[notebooks]"`.
# The same as `jupyter lab chapters/`, except that a double-click opens a chapter's MyST .md file as a notebook
# (jupytext's "Jupytext Notebook" viewer) instead of as text. That default comes from scripts/jupyter/labconfig,
# put on JUPYTER_CONFIG_PATH for this server only: your own JupyterLab settings are left as they are.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
export JUPYTER_CONFIG_PATH="$root/scripts/jupyter${JUPYTER_CONFIG_PATH:+:$JUPYTER_CONFIG_PATH}"
exec jupyter lab "$@" "$root/chapters"
