#!/usr/bin/env bash
# Set up a Cloud TPU VM for this project: a virtual environment, JAX for TPU, the project's
# requirements, then print the TPU devices JAX sees.
#
#   bash prepareTPUVM.sh             # from a checkout of this repository, on every worker of the VM
#   bash prepareTPUVM.sh --dry-run   # print each command instead of running it
#
# Safe to run again: an existing environment is reused and pip skips what is installed already.
# On a pod, run it on all workers at once (the README's `--worker=all`): the final check starts the
# TPU runtime, which waits for every host of the slice.
#
# Environment:
#   VENV        where the virtual environment goes (default: .venv in the repository)
#   PYTHON      the interpreter to build it from (default: the newest python3.x >= 3.11 on PATH;
#               without one, uv installs a standalone Python 3.12)
#   JAX_SPEC    the JAX-for-TPU requirement (default: jax[tpu]>=0.10.2, the versions this project supports)
set -euo pipefail

usage() {
    sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
}

dry_run=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) dry_run=1 ;;
        -h | --help) usage; exit 0 ;;
        *) echo "error: unknown argument '$arg' (usage: bash prepareTPUVM.sh [--dry-run])" >&2; exit 2 ;;
    esac
done

root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${VENV:-$root/.venv}"
jax_spec="${JAX_SPEC:-jax[tpu]>=0.10.2}"
min_minor=11  # Python 3.11: what JAX, Flax and orbax require

# Print a command, quoting the words that need it, or run it.
run() {
    if [[ $dry_run == 1 ]]; then
        local word out=()
        for word in "$@"; do
            if [[ $word =~ ^[A-Za-z0-9_./=:,@%+-]+$ ]]; then
                out+=("$word")
            elif [[ $word != *"'"* ]]; then
                out+=("'$word'")
            elif [[ $word != *[\"\$\`\\]* ]]; then
                out+=("\"$word\"")
            else
                out+=("$(printf '%q' "$word")")
            fi
        done
        echo "${out[*]}"
    else
        "$@"
    fi
}

step() { echo "==> $*"; }

# An interpreter is good enough if it is Python 3.x with x >= min_minor.
python_ok() {
    "$1" -c "import sys; sys.exit(0 if sys.version_info >= (3, $min_minor) else 1)" 2>/dev/null
}

# ------------------------------------------------------------------------------------------------
# 1. The virtual environment (reused when it exists and its Python is recent enough)
vpy="$venv/bin/python"
if [[ -x $vpy ]] && python_ok "$vpy"; then
    step "reusing the virtual environment $venv"
elif [[ -e $venv ]]; then
    echo "error: $venv exists but holds no Python >= 3.$min_minor; remove it, or set VENV to another place" >&2
    exit 2
else
    python="${PYTHON:-}"
    if [[ -n $python ]] && ! python_ok "$python"; then
        echo "error: PYTHON=$python is not a Python >= 3.$min_minor" >&2
        exit 2
    fi
    if [[ -z $python ]]; then
        for candidate in python3.13 python3.12 python3.11 python3; do
            if command -v "$candidate" >/dev/null && python_ok "$candidate"; then python="$candidate"; break; fi
        done
    fi
    if [[ -n $python ]] && python_ok "$python"; then
        if ! "$python" -c "import ensurepip" 2>/dev/null; then  # Debian and Ubuntu split venv off
            version="$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
            run sudo apt-get install -y "python$version-venv"
        fi
        step "creating the virtual environment $venv with $python"
        run "$python" -m venv "$venv"
    else
        # The older TPU VM images ship Python 3.10: uv brings a standalone Python 3.12.
        step "no Python >= 3.$min_minor found: creating $venv with uv and Python 3.12"
        uv="$HOME/.local/bin/uv"
        if [[ ! -x $uv ]]; then
            run python3 -m pip install --user --upgrade uv
        fi
        run "$uv" venv --seed --python 3.12 "$venv"
    fi
fi

# ------------------------------------------------------------------------------------------------
# 2. JAX for TPU (libtpu comes from PyPI as a dependency of the tpu extra), then the project
step "installing $jax_spec"
run "$vpy" -m pip install --upgrade pip
run "$vpy" -m pip install "$jax_spec"
step "installing the project's requirements"
run "$vpy" -m pip install -r "$root/requirements.txt"
step "installing gcsfs, for gs:// data and run directories"
run "$vpy" -m pip install gcsfs

# ------------------------------------------------------------------------------------------------
# 3. The check: the devices JAX sees on this host and in the whole slice
step "the TPU devices JAX sees"
run "$vpy" -c "import jax; print('process', jax.process_index(), 'of', jax.process_count(), jax.devices())"
if [[ $dry_run == 0 ]]; then
    echo "done: activate the environment with  source $venv/bin/activate"
fi
