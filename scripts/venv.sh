#!/usr/bin/env bash
# Create or refresh the local virtual environment (.venv, or $MPIDP_VENV) and
# install this checkout into it the way a user does: an editable install,
# `pip install -e ".[EXTRAS]"` with the extras named in "$@" (setup.cfg lists
# them). Sourced by scripts/demo and scripts/test; run it directly to set up
# by hand.
# PyTorch is pinned to torch==2.13.0 here: the range in setup.cfg would pull
# the newest CUDA build and its nvidia packages, several GB. A torch 2.13.0
# already in the environment (e.g. the CPU build, docs/install.md) is kept.
# The installer runs again only when setup.cfg, pyproject.toml, the version
# or the extras change. uv (from the registry pip uses, into the venv) does the
# install with pip's own settings (indexes, find-links, constraints, cert) and
# compiles the bytecode on every core: 40-60 s on a fresh 2-core machine
# where pip takes 100 s. Where uv cannot, or with MPIDP_INSTALLER=pip, pip does.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${MPIDP_VENV:-$root/.venv}
if [ ! -x "$venv/bin/python" ]; then
  echo "mpidp: creating the virtual environment $venv" >&2
  "${PYTHON:-python3}" -m venv "$venv"
fi
py="$venv/bin/python"
extras=$(IFS=,; echo "$*")
requirements=("$root${extras:+[$extras]}")
case ",$extras," in *,torch,*) requirements+=("torch==2.13.0") ;; esac
# the stamp: a checksum of the package metadata, then the extras installed with it
stamp="$venv/.mpidp-install"
want=$(cat "$root/setup.cfg" "$root/pyproject.toml" "$root/mpidp/__init__.py" <(echo "$root") | cksum)
have=()
missing=1
if [ "$(head -n 1 "$stamp" 2>/dev/null)" = "$want" ]; then
  mapfile -t have < <(tail -n +2 "$stamp")
  missing=0
fi
for extra in "$@"; do
  case " ${have[*]} " in *" $extra "*) ;; *) missing=1 ;; esac
done
pip_install() {  # pip install, quiet, its status (the venv's scripts dir warning filtered out)
  "$py" -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "^WARNING: Location" >&2
  return "${PIPESTATUS[0]}"
}
uv_install() {  # uv into the venv, then uv installs the requirements with pip's settings (uv reads neither pip's files nor PIP_*)
  pip_install uv || return 1
  "$py" - "$venv/bin/uv" -e "${requirements[@]}" <<'PY'
import ast, os, subprocess, sys
listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
settings = {}  # pip lists its files' settings, then PIP_* variables: the last of a name wins, as in pip
for line in listed.splitlines():
    key, _, value = line.partition("=")
    try:
        settings[key.rsplit(".", 1)[-1]] = str(ast.literal_eval(value))
    except (ValueError, SyntaxError):
        pass
args = ["pip", "install", "--python", sys.executable, "--quiet", "--compile-bytecode", "--index-strategy", "unsafe-best-match"]
for name, flag in (("index-url", "--index-url"), ("extra-index-url", "--extra-index-url"), ("find-links", "--find-links"), ("constraint", "--constraints")):
    for value in settings.get(name, "").split():
        args += [flag, value]
if settings.get("no-index", "").lower() in ("1", "true", "yes", "on"):
    args.append("--no-index")
env = dict(os.environ)
if settings.get("cert") and "SSL_CERT_FILE" not in env:
    env["SSL_CERT_FILE"] = settings["cert"]
sys.exit(subprocess.run([sys.argv[1], *args, *sys.argv[2:]], env=env).returncode)
PY
}
if [ "$missing" = 1 ] || ! "$py" -I -c "import mpidp" 2>/dev/null; then
  echo "mpidp: installing into $venv (first run, or the package metadata changed; may take minutes):" >&2
  "$py" - "$root/setup.cfg" "$@" >&2 <<'PY'
import configparser, sys
cfg = configparser.ConfigParser()
cfg.read(sys.argv[1])
lines = cfg["options"]["install_requires"].split("\n")
for extra in sys.argv[2:]:
    lines += cfg["options.extras_require"][extra].split("\n")
shown = list(dict.fromkeys(line.strip() for line in lines if line.strip()))
shown = ["torch==2.13.0 (CPU or CUDA build: docs/install.md)" if s.startswith("torch") else s for s in shown]
print("mpidp:   mpidp (editable, from this checkout), " + ", ".join(shown))
PY
  rm -f "$stamp"
  set +e
  status=1
  if [ "${MPIDP_INSTALLER:-uv}" = uv ]; then
    uv_install
    status=$?
    [ "$status" = 0 ] || echo "mpidp: uv could not install (exit $status); pip installs instead" >&2
  fi
  if [ "$status" != 0 ]; then
    pip_install -e "${requirements[@]}"
    status=$?
  fi
  set -e
  if [ "$status" != 0 ]; then
    echo "mpidp: the install failed (exit $status)" >&2
    (exit "$status")
  fi
  "$py" -I -c "import mpi4py, numpy, ml_dtypes, mpidp" # fail here, not later, if the install did not work
  printf "%s\n" "$want" "${have[@]}" "$@" | awk '!seen[$0]++' > "$stamp"
fi
# a checkout path written by earlier versions of this script: the editable install replaces it
rm -f "$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/mpidp-checkout.pth"
export PATH="$venv/bin:$PATH"
