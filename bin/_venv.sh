# Sourced by bin/jaxdp and bin/test: makes sure the local virtual environment
# .venv holds jaxdp (editable) with its command-line and test extras and the CPU
# build of torch, and sets $venv. Reinstalls when pyproject.toml, the
# constraints or $JAXDP_TORCH_INDEX change.
#
# Byte code: pip installs with --no-compile (compiling all 16,000 modules of torch, jax
# and the rest took two thirds of a fresh .venv's minute, most of them never imported),
# and Python writes each module's .pyc at its first import instead. So the processes
# started from here write them even where PYTHONDONTWRITEBYTECODE is set (it is on some
# machines: there every process compiled torch and jax from source at each start).
unset PYTHONDONTWRITEBYTECODE
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"
stamp="$venv/.installed-from"
want=$( (cat "$root/pyproject.toml" "$root/constraints/cpu.txt"; echo "${JAXDP_TORCH_INDEX:-}") | sha256sum | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setting up $venv (one time, about a minute) ..." >&2
  "${PYTHON:-python3}" -m venv "$venv"
  # torch is pinned by the constraints. On these machines torch==2.13.0 is a
  # local CPU wheel; elsewhere set JAXDP_TORCH_INDEX=https://download.pytorch.org/whl/cpu
  # for PyTorch's CPU build (a bare `torch` from PyPI is several GB of CUDA wheels).
  index=()
  if [ -n "${JAXDP_TORCH_INDEX:-}" ]; then index=(--extra-index-url "$JAXDP_TORCH_INDEX"); fi
  # A current pip first: the one a venv starts with (Python 3.11's 23.2) spent 43 of its
  # 62 CPU s resolving (93,544 index links weighed); pip 26 installs the same packages
  # in 28 CPU s, its own upgrade costing 2.
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade "pip>=26"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile \
    -e "$root[cli,test]" torch "${index[@]}" -c "$root/constraints/cpu.txt"
  echo "$want" >"$stamp"
fi
