#!/usr/bin/env bash
# Create or refresh the local virtual environment (.venv, or $MPIDP_VENV) and
# put this checkout on its path. Sourced by scripts/demo and scripts/test;
# run it directly to set up by hand. Installs, from PyPI: the requirements and
# the extras named in "$@" as setup.cfg lists them, with PyTorch pinned to
# torch==2.13.0 (the range in setup.cfg would pull the newest, multi-GB CUDA
# build; on the development machines the pin resolves to a local CPU wheel).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${MPIDP_VENV:-$root/.venv}
if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
py="$venv/bin/python"
extras=("$@")
mapfile -t reqs < <("$py" - "$root/setup.cfg" "${extras[@]}" <<'PY'
import configparser, sys
cfg = configparser.ConfigParser()
cfg.read(sys.argv[1])
lines = cfg["options"]["install_requires"].split("\n")
for extra in sys.argv[2:]:
    lines += cfg["options.extras_require"][extra].split("\n")
for line in lines:
    line = line.strip()
    # the test and demo set-up pins torch: a range would pull a multi-GB CUDA build
    if line.startswith("torch"):
        line = "torch==2.13.0"
    if line:
        print(line)
PY
)
"$py" -m pip install -q --disable-pip-version-check "${reqs[@]}" 2>&1 | grep -v "^WARNING: Location" >&2 || true
"$py" -c "import mpi4py, numpy, ml_dtypes" # fail here, not later, if the install did not work
site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$root" > "$site/mpidp-checkout.pth"
export PATH="$venv/bin:$PATH"
