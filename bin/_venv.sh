# Sourced by bin/jaxdp and bin/test: makes sure the local virtual environment
# .venv holds jaxdp (editable) with its torch and test extras, and sets $venv.
# Reinstalls when pyproject.toml or the constraints change.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"
stamp="$venv/.installed-from"
want=$(cat "$root/pyproject.toml" "$root/constraints/cpu.txt" | sha256sum | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setting up $venv (one time, about a minute) ..." >&2
  "${PYTHON:-python3}" -m venv "$venv"
  # The constraints pin the CPU build of torch: a bare `torch` would pull
  # several GB of CUDA wheels.
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    -e "$root[torch,test]" -c "$root/constraints/cpu.txt"
  echo "$want" >"$stamp"
fi
