#!/usr/bin/env bash
# The whole test suite, with its set-up: installs fa2edu with its test, notebook, docs and torch extras (PyTorch's
# CPU-only build where there is no NVIDIA driver), then runs pytest.
# Extra arguments go to pytest. Kernels run in numba's CUDA simulator (tests/conftest.py selects it).
#
# The install runs only when needed: build/test-env.stamp (git-ignored) holds a hash of pyproject.toml, the torch
# pin and the Python environment of the last successful install, and the environment must still hold fa2edu
# installed from this checkout and the packages the suite imports. A fresh clone (CI) has no stamp: it installs.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH="torch==2.13.0"
STAMP=build/test-env.stamp

key="$(python3 -c 'import hashlib, sys; print(hashlib.sha256(open("pyproject.toml", "rb").read()
       + "|".join([sys.argv[1], sys.prefix, sys.version]).encode()).hexdigest())' "$TORCH")"

installed() {
    python3 - <<'EOF'
import importlib.metadata, importlib.util, json, os, sys, urllib.parse

# What the suite imports, from the test, notebooks, docs and torch extras.
modules = ("pytest", "xdist", "hypothesis", "jupytext", "jupyterlab", "nbclient", "nbformat", "ipykernel", "torch",
           "sphinx", "myst_nb", "furo")
missing = [name for name in modules if importlib.util.find_spec(name) is None]
# fa2edu installed in editable mode from this checkout, looked up outside the checkout: its fa2edu.egg-info
# (setuptools' build metadata) would otherwise answer for whichever environment installed it last.
repo = os.path.realpath(".")
site = [path for path in sys.path if os.path.realpath(path or ".") != repo]
urls = [json.loads(dist.read_text("direct_url.json") or "{}")
        for dist in importlib.metadata.distributions(name="fa2edu", path=site)]
here = [url for url in urls if url.get("dir_info", {}).get("editable")
        and os.path.realpath(urllib.parse.urlparse(url.get("url", "")).path) == repo]
sys.exit(0 if here and not missing else 1)
EOF
}

if [[ "$(cat "$STAMP" 2>/dev/null)" == "$key" ]] && installed; then
    echo "scripts/test.sh: the environment is up to date with pyproject.toml (delete $STAMP to reinstall)"
else
    # PyTorch's CPU-only build on a machine without an NVIDIA driver: a plain `pip install torch` on Linux brings
    # several GB of CUDA libraries that the suite (numba's CUDA simulator, CPU tensors) never loads.
    if ! python3 -c "import torch" 2>/dev/null; then
        index=()
        command -v nvidia-smi >/dev/null 2>&1 || index=(--index-url https://download.pytorch.org/whl/cpu)
        python3 -m pip install --quiet --disable-pip-version-check --retries 1 "$TORCH" "${index[@]}"
    fi
    python3 -m pip install --quiet --disable-pip-version-check -e ".[test,notebooks,docs,torch]" "$TORCH"
    mkdir -p "$(dirname "$STAMP")" && echo "$key" > "$STAMP"
fi
# Three workers on CI's two cores, stealing queued tests from each other: the chapters and the docs build spend much
# of their time in a subprocess (a Jupyter kernel, Sphinx) while their worker waits, and a few simulated kernels
# take 10-45 s, which without stealing can leave a worker idle at the end.
python3 -m pytest -n 3 --dist worksteal "$@"
