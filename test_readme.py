"""The README's commands (and docs/'s), so that none can drift from the code: every command line of its ```bash
blocks is run or checked, its Python snippet runs against real exports, the plan it prints and its
table of plans are what `train.py --plan` prints now, and `python gcs_emulator.py` gives a bucket.

Each command line (backslash continuations joined, comments dropped, `&&`, `||`, `;`, `&` and
redirections split off, leading `NAME=value` settings dropped) is checked by what it runs:

    python SCRIPT.py ARGS   the script exists and its own parser accepts ARGS, without running the
                            work: train.py, data.py, eval.py, sample.py, serve.py, convert_torch.py, plot.py
                            and gcs_emulator.py by their parse_args (before JAX loads), bench.py by its
                            main with the benchmarks replaced; train.py's config with its overrides is
                            loaded too (a renamed key fails), and `train.py --plan` runs for real
    bash prepareTPUVM.sh --dry-run   runs for real
    bench/gpu.sh, bench/gpu-run.sh   the script exists and knows every phase named
    pip install -r FILE     FILE exists; `python3 -m venv .venv`, `. .venv/bin/activate` and other pip,
                            pytest, git, gcloud, srun, nohup, cd lines: allowed external tools, with the
                            command inside `gcloud ... --command` and after `srun`/`nohup` checked as above

Placeholders (docs/reference.md says so at its top): the words in PLACEHOLDERS are
the user's to fill in; each is replaced by its value here, and a word in CAPITALS left over is an
undocumented placeholder, which fails.
"""
import ast
import contextlib
import io
import json
import os
import pathlib
import re
import shlex
import shutil
import socket
import struct
import subprocess
import sys
import urllib.request

import pytest

from test_train import corpus  # noqa: F401  (a fixture)

REPO = pathlib.Path(__file__).resolve().parent
README = REPO / "README.md"

# What the README's reader fills in, and the value the checks below use for it.
PLACEHOLDERS = {
    "BUCKET": "readme-bucket",  # a Cloud Storage bucket of yours (gs://BUCKET/...)
    "YOU/THIS_REPO": "you/gpt-jax",  # where your copy of this repository lives on GitHub
    "HOST": "localhost",  # a Flink or Spark master
    "OUT": "/tmp/readme-bench-out",  # where bench/gpu.sh puts its records
    "$i": "0",  # this node's index on a multi-node cluster
    "my-project": "readme-project",  # a Google Cloud project
    "path/to/gpt2": "/tmp/readme-models/gpt2",  # a transformers checkpoint directory you downloaded
    "path/to/pythia-160m": "/tmp/readme-models/pythia-160m",
    "corpus/**/*.txt": "/tmp/readme-corpus/**/*.txt",  # your text files
    "corpus/*.txt": "/tmp/readme-corpus/*.txt",
    "extra.jsonl.zst": "/tmp/readme-corpus/extra.jsonl.zst",
    "pile/*.jsonl.zst": "/tmp/readme-corpus/pile/*.jsonl.zst",
    "/mnt/corpus/pile/*.jsonl.zst": "/tmp/readme-corpus/pile/*.jsonl.zst",  # on a file system the workers share
    "pairs.jsonl": "/tmp/readme-corpus/pairs.jsonl",  # your prompt/completion pairs
}
CAPITAL_WORDS = {"DOCKER"}  # words in capitals that are real values (Beam's environment_type), not placeholders
SERVED = "http://127.0.0.1:8000"  # serve.py's default address
SERVED_PATHS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/tokenize", "/detokenize"}
EXTERNAL = {"pip", "pytest", "git", "gcloud", "srun", "nohup", "cd",  # tools checked no further (but what they run)
            "hf"}  # huggingface_hub's command (hf download)
PYTHONS = {"python", "python3", ".venv/bin/python"}


# ------------------------------------------------------------------------------------------------
# Reading the README


def blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```$", text, flags=re.S | re.M)


def command_lines(body: str) -> list[str]:
    """A bash block's command lines: continuations joined, comment and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", body)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def fill(line: str) -> str:
    """The line with every placeholder replaced by its value (longest first): a name as a whole word, a
    file name or glob (with a dot or a star) only where an argument starts."""
    for name in sorted(PLACEHOLDERS, key=len, reverse=True):
        before = r"(?<![^\s'\"=])" if re.search(r"[.*]", name) else r"(?<![\w.-])"
        line = re.sub(before + re.escape(name) + r"(?![\w-])", lambda _: PLACEHOLDERS[name], line)
    return line


def uncommented(line: str) -> str:
    """The line without its comment: from an unquoted # that starts a word to the end."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line, as argument lists: split at && || ; | &, redirections and
    a trailing comment dropped, leading NAME=value settings dropped."""
    lexer = shlex.shlex(uncommented(line), posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, ""
    out, current, tokens = [], [], list(lexer)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token in ("&&", "||", ";", "|", "&"):
            out.append(current)
            current = []
        elif token in (">", ">>", "<", ">&", "2>"):
            if current and current[-1].isdigit():  # 2>&1: the 2 belongs to the redirection
                current.pop()
            i += 1  # the redirection's target
        else:
            current.append(token)
        i += 1
    out.append(current)
    commands = []
    for argv in out:
        while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", argv[0]):
            argv = argv[1:]
        if argv:
            commands.append(argv)
    return commands


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]  # the front door, and the reference it links to
TEXT = "\n".join(doc.read_text() for doc in DOCS)
BLOCKS = blocks(TEXT)
BASH_LINES = [line for lang, body in BLOCKS if lang == "bash" for line in command_lines(body)]


# ------------------------------------------------------------------------------------------------
# Checking one command


PLANS: dict[tuple[str, ...], str] = {}  # what `train.py --plan ARGS` printed, by ARGS: each runs once here


class Checker:
    """Checks command lines (`line`); `plans` maps each `train.py --plan` line checked to what it printed."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch
        self.plans: dict[str, str] = {}
        self.runs: dict[str, list[str]] = {}  # run_dir -> the overrides of the line that started it

    def line(self, line: str) -> None:
        filled = fill(line)
        for argv in commands(filled):
            self.command(argv, line)

    def command(self, argv: list[str], line: str) -> None:
        leftover = [w for w in re.findall(r"\b[A-Z][A-Z0-9_]{2,}\b", " ".join(argv)) if w not in CAPITAL_WORDS]
        assert not leftover, f"{line}: {leftover} look like placeholders: add them to PLACEHOLDERS"
        prog, args = argv[0], argv[1:]
        if prog in PYTHONS:
            if args[:2] == ["-m", "venv"]:
                return
            script, args = args[0], args[1:]
            assert (REPO / script).is_file(), f"{line}: no {script} in the repository"
            getattr(self, "script_" + pathlib.Path(script).stem)(args, line)
        elif prog in (".", "source"):
            assert args == [".venv/bin/activate"], line
        elif prog == "bash":
            assert (REPO / args[0]).is_file(), f"{line}: no {args[0]}"
            if args == ["prepareTPUVM.sh", "--dry-run"]:
                done = subprocess.run(["bash", *args], cwd=REPO, capture_output=True, text=True, timeout=60)
                assert done.returncode == 0 and "pip install" in done.stdout, done.stderr
        elif prog.startswith("bench/"):
            self.gpu_script(prog, args, line)
        elif prog == "pip":
            for i, arg in enumerate(args):
                if arg == "-r":
                    assert (REPO / args[i + 1]).is_file(), f"{line}: no {args[i + 1]}"
        elif prog == "gcloud":
            if "--command" in args:  # what runs on the workers
                self.line(args[args.index("--command") + 1])
        elif prog == "srun":
            rest = list(args)
            while rest and rest[0].startswith("-"):
                rest.pop(0)
            self.command(rest, line)
        elif prog == "nohup":
            self.command(args, line)
        elif prog == "curl":  # a request to serve.py at its default address (test_serve.py sends it for real)
            url = next(a for a in args if a.startswith("http"))
            assert url.startswith(SERVED), f"{line}: not serve.py's default address {SERVED}"
            assert url.removeprefix(SERVED) in SERVED_PATHS, f"{line}: serve.py has no {url.removeprefix(SERVED)}"
            if "-d" in args:
                json.loads(args[args.index("-d") + 1])
        elif prog == "lm_eval":  # lm-eval's own command, pointed at serve.py
            assert args[args.index("--model") + 1] == "local-completions", line
            model_args = dict(kv.split("=", 1) for kv in args[args.index("--model_args") + 1].split(","))
            assert model_args["base_url"] == SERVED + "/v1/completions" and model_args["tokenizer_backend"] == "remote"
            assert "max_length" in model_args, f"{line}: lm-eval's default max_length (2048) is past the context"
        else:
            assert prog in EXTERNAL, f"{line}: {prog} is neither checked here nor an allowed external tool"

    # the scripts, each through its own parser

    def script_train(self, args, line):
        import train
        from training import config

        parsed = train.parse_args(args)
        path = REPO / parsed.config if parsed.config else config.DEFAULT_CONFIG
        # a resume's overrides apply to its run's own config: the one an earlier line of the page made there
        made = self.runs.get(config.run_dir_of(path, parsed.overrides), []) if parsed.resume else []
        config.load_config(path, [*made, *parsed.overrides])
        if not parsed.resume:
            self.runs[config.run_dir_of(path, parsed.overrides)] = list(parsed.overrides)
        if parsed.plan:
            if tuple(args) not in PLANS:
                out = io.StringIO()
                with contextlib.redirect_stdout(out):
                    assert train.cli(args) == 0, line
                PLANS[tuple(args)] = out.getvalue()
            self.plans[line] = PLANS[tuple(args)]

    def script_data(self, args, line):
        import data

        data.parse_args(args)

    def script_eval(self, args, line):
        import tempfile

        import eval as eval_lib

        if "--include-path" in args:  # the reader's own directory of tasks (which the parser wants to exist)
            args = list(args)
            args[args.index("--include-path") + 1] = tempfile.mkdtemp(prefix="readme-tasks-")
        eval_lib.parse_args(args)

    def script_sample(self, args, line):
        import sample

        sample.parse_args(args)

    def script_serve(self, args, line):
        import serve

        serve.parse_args(args)

    def script_convert_torch(self, args, line):
        import convert_torch

        convert_torch.parse_args(args)

    def script_plot(self, args, line):
        import plot

        plot.parse_args(args)

    def script_gcs_emulator(self, args, line):
        import gcs_emulator

        gcs_emulator.parse_args(args)

    def script_bench(self, args, line):
        import bench

        ran = []
        for name in ("bench_data", "bench_train", "bench_attention", "bench_recipe", "bench_serve", "bench_dpo",
                     "bench_mixture"):
            self.monkeypatch.setattr(bench, name, lambda parsed, argv, name=name: ran.append(name) or 0)
        assert bench.main(args) == 0 and ran == ["bench_" + args[0]], line

    def gpu_script(self, prog, args, line):
        assert (REPO / prog).is_file(), f"{line}: no {prog}"
        phases = set(re.findall(r"^phase_(\w+)\(\)", (REPO / "bench/gpu.sh").read_text(), flags=re.M))
        named = args[2:] if prog == "bench/gpu-run.sh" else args[1:]  # OUT [SECONDS] PHASE...
        if prog == "bench/gpu-run.sh":
            assert args[1].isdigit(), line
        assert named and set(named) <= phases, f"{line}: phases {set(named) - phases} unknown to bench/gpu.sh"


# ------------------------------------------------------------------------------------------------
# The tests


def test_the_reader_reads_the_readme():
    """The helpers find what the README plainly holds (guards the tests below against checking nothing)."""
    assert len(BASH_LINES) > 40 and sum(lang == "python" for lang, _ in BLOCKS) == 4
    assert commands("A=1 B=2 python x.py --k 'a b' > log 2>&1 && git pull || true &") == [
        ["python", "x.py", "--k", "a b"], ["git", "pull"], ["true"]]
    assert anchor("Fine-tuning on prompt/completion pairs") == "fine-tuning-on-promptcompletion-pairs"


def test_every_command_line_runs_or_parses(monkeypatch):
    checker = Checker(monkeypatch)
    for line in BASH_LINES:
        checker.line(line)
    assert checker.plans, "no train.py --plan line was run"


def test_the_printed_plan_is_what_the_plan_prints(monkeypatch):
    """The output block after the --plan command is what that command prints now."""
    checker = Checker(monkeypatch)
    compared = 0
    for (lang, body), (next_lang, next_body) in zip(BLOCKS, BLOCKS[1:]):
        lines = command_lines(body) if lang == "bash" else []
        if any("--plan" in line for line in lines):
            assert len(lines) == 1 and next_lang == "text", "a --plan command block is followed by its output"
            checker.line(lines[0])
            assert next_body.rstrip("\n") == checker.plans[lines[0]].rstrip("\n"), (
                f"the README's plan output is stale; it prints now:\n{checker.plans[lines[0]]}")
            compared += 1
    assert compared == 1


def plan_lines(args: list[str]) -> list[str]:
    """What `train.py --plan ARGS` prints, line by line."""
    import train

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert train.cli(["--plan", *args]) == 0
    return out.getvalue().splitlines()


def verdict_of(lines: list[str]) -> tuple[float, str, str, str]:
    """(total GiB, share, verdict kind, the first change offered or '') of a plan's printed lines."""
    verdict = next(line for line in lines if line.startswith(("fits:", "tight:", "does not fit:")))
    heading = next((i for i, line in enumerate(lines) if line.startswith(("changes that fit", "no single change"))),
                   None)
    change = ""
    if heading is not None:
        what, size = re.fullmatch(r"(.*?)\s{2,}(\S+ GiB \(\d+%\))", lines[heading + 1].strip()).groups()
        change = f"`{what}`: {size}"
    return (float(re.search(r"([\d.]+) (?:GiB needed|of)", verdict)[1]), re.search(r"\((\d+%)\)", verdict)[1],
            verdict.split(":")[0], change)


def plan_row(model: str, device: str, batch: int, micro: int) -> str:
    """The README table's row for one configuration, from what `train.py --plan` prints for it."""
    lines = plan_lines(["--device", *device.split(), f"model={model}", "model.dtype=bfloat16",
                        f"training.batch_size={batch}", f"training.micro_batches={micro}",
                        "training.loss_chunk=4096", "sharding.zero_stage=1"])
    devices = re.search(r" on (.*?)(, \d+ host|$)", lines[0])[1]
    shape = re.search(r"batch (\d+) x (\d+) tokens in (\d+) micro-batch\(es\): (\d+) sequence", lines[1])
    total, share, kind, change = verdict_of(lines)
    recommends = "ZeRO 1 as it is" if kind == "fits" else change or "more devices"
    return (f"| `{model}` | `{device}` | {devices} | {shape[1]} x {shape[2]} ({shape[3]}) | {shape[4]} | "
            f"{total:.1f} GiB ({share}): {kind} | {recommends} |")


def stale_rows(heading: str, row_now, at_least: int) -> list[str]:
    """The rows of the README's table under `heading` that differ from what `row_now(cells)` makes now,
    as it makes them."""
    section = re.split(r"\n#{1,3} ", TEXT.split(f"### {heading}")[1])[0]  # up to the next heading, in any file
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert len(rows) >= at_least
    now = [row_now([c.strip() for c in row.strip("|").split("|")]) for row in rows]
    return [n for n, row in zip(now, rows) if n != row]


def test_the_plan_table_is_what_the_plan_prints():
    def row_now(cells):
        batch, micro = re.fullmatch(r"(\d+) x \d+ \((\d+)\)", cells[3]).groups()
        return plan_row(cells[0].strip("`"), cells[1].strip("`"), int(batch), int(micro))

    stale = stale_rows("What the plan says for the named sizes", row_now, 5)
    assert not stale, "rows of the README's plan table are stale; they print now:\n" + "\n".join(stale)


LORA_PLAN = ["training.lora.rank=8", "training.lora.base_dtype=bfloat16"]


def lora_plan_row(model: str, device: str, batch: int, context: int) -> str:
    """The README's LoRA table row: full fine-tuning and LoRA (rank 8 on q and v, a bfloat16 base) of one
    configuration, from what `train.py --plan` prints for each."""
    args = ["--device", device, f"model={model}", "model.dtype=bfloat16", f"training.batch_size={batch}",
            f"training.seq_len={context}", "training.loss_chunk=4096", "training.init_from=runs/base"]
    full, lora = verdict_of(plan_lines(args)), verdict_of(plan_lines(args + LORA_PLAN))
    return (f"| `{model}` | `{device}` | {batch} x {context} | {full[0]:.1f} GiB ({full[1]}): {full[2]} | "
            f"{lora[0]:.1f} GiB ({lora[1]}): {lora[2]} | {lora[3] or 'as it is'} |")


def test_the_lora_plan_table_is_what_the_plan_prints():
    def row_now(cells):
        batch, context = re.fullmatch(r"(\d+) x (\d+)", cells[2]).groups()
        return lora_plan_row(cells[0].strip("`"), cells[1].strip("`"), int(batch), int(context))

    stale = stale_rows("What the plan says for LoRA on one GPU", row_now, 4)
    assert not stale, "rows of the README's LoRA plan table are stale; they print now:\n" + "\n".join(stale)


def test_the_links_reach_files_and_headings_and_the_test_command_is_ci():
    """Every link of the README and docs/ to a file of the repository reaches it, and one to a heading
    (#anchor, in the same file or another) reaches the heading."""
    headings = {doc.resolve(): {anchor(h) for h in re.findall(r"^#{1,4} (.+)$", doc.read_text(), flags=re.M)}
                for doc in DOCS}
    broken, checked = [], 0
    for doc in DOCS:
        for target, fragment in re.findall(r"\]\((?!https?:)([^)#\s]*)(?:#([^)\s]+))?\)", doc.read_text()):
            path = (doc.parent / target).resolve() if target else doc.resolve()
            checked += 1
            if not path.exists() or (fragment and fragment not in headings.get(path, set())):
                broken.append(f"{doc.name}: {target}#{fragment}")
    assert checked > 20 and not broken, broken
    ci = [line for line in (REPO / ".ci/run").read_text().splitlines() if line and not line.startswith(("#", "set", "cd"))]
    assert ci and ci[-1] in BASH_LINES  # .ci/run runs the README's test command exactly as written


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """export/default and export/default-hf as the README's convert_torch.py commands write them
    (convert_torch.export, what they call), of a `test`-size model with random weights and a tokenizer
    trained on a few lines of text: no training run, so that this file stays fast."""
    import dataclasses

    import jax
    import numpy as np
    from flax import nnx

    import convert_torch
    import model
    from layers import lora as lora_lib
    from tokendata import shard_writer
    from training import config
    root = tmp_path_factory.mktemp("readme")
    docs = [f"def main(argv): return {i} + {i * i}  # the cat sat on the mat\n" for i in range(200)]
    tok = shard_writer.train_tokenizer(iter(docs), 300)
    tok.save(str(root / "tokenizer.json"))
    cfg = dataclasses.replace(config.load_config(overrides=["model=test"]).model, vocab_size=tok.get_vocab_size())
    shapes = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: model.GPT(cfg, rngs=nnx.Rngs(params=0)))))
    rng = np.random.default_rng(0)  # random weights (the snippet only needs them to load and run)
    params = jax.tree.map(lambda a: rng.normal(0, 0.02, a.shape).astype(a.dtype), shapes)
    convert_torch.export(params, cfg, root / "export" / "default", "torch", root / "tokenizer.json")
    convert_torch.export(params, cfg, root / "export" / "default-hf", "hf", root / "tokenizer.json")
    # the LoRA section's: an adapter (random, B too) and its base in the transformers layout
    lora = config.LoRAConfig(rank=4, targets=["q", "v", "mlp"])
    adapters = lora_lib.split(jax.tree.map(lambda a: rng.normal(0, 0.02, a.shape).astype(a.dtype), nnx.to_pure_dict(
        nnx.state(nnx.eval_shape(lambda: model.GPT(cfg, lora=lora, rngs=nnx.Rngs(params=0)))))))[1]
    convert_torch.export_adapter(adapters, cfg, lora, root / "export" / "gpt2-lora-adapter")
    return root


def test_the_pytorch_snippet_runs_and_its_install_lines_name_what_it_imports(exports, tmp_path, monkeypatch, capsys):
    """The snippet runs from any directory, its checkout (path/to/gpt-jax) named: torch_gpt.py is imported
    from there, not from where Python happens to run."""
    (snippet,) = [body for lang, body in BLOCKS if lang == "python" and "torch_gpt" in body]
    checkout = tmp_path / "checkout"  # the README's convert_torch.py commands wrote export/default and -hf in it
    shutil.copytree(exports / "export", checkout / "export")
    (checkout / "interop").mkdir()
    shutil.copyfile(REPO / "interop" / "torch_gpt.py", checkout / "interop" / "torch_gpt.py")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "torch_gpt", raising=False)  # (the suite imports it as interop.torch_gpt)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(REPO))])
    names = {"__name__": "readme_snippet"}
    exec(compile(snippet.replace("path/to/gpt-jax", str(checkout)), "README.md's snippet", "exec"), names)
    assert sys.modules["torch_gpt"].__file__ == str(checkout / "interop" / "torch_gpt.py")
    assert capsys.readouterr().out.startswith("def main(")  # the prompt and its continuation

    # every package the snippet and torch_gpt.py import is in the install lines before it
    section = TEXT.split("## Exporting to PyTorch and Hugging Face")[1].split("\n## ")[0]
    installs = [argv for lang, body in blocks(section) if lang == "bash" for line in command_lines(body)
                for argv in commands(line) if argv[:2] == ["pip", "install"]]
    named = {a for argv in installs for a in argv[2:] if not a.startswith("-") and "://" not in a}
    imported = set()
    for source in (snippet, (REPO / "interop" / "torch_gpt.py").read_text()):
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module.split(".")[0])
    needed = imported - set(sys.stdlib_module_names) - {"torch_gpt", "__future__"}
    assert needed and needed <= named, f"not in the README's pip install lines: {needed - named}"
    # torch from PyTorch's CPU index (plain PyPI gives the CUDA build)
    assert ["pip", "install", "torch", "--index-url", "https://download.pytorch.org/whl/cpu"] in installs


def test_the_local_task_is_what_lm_eval_reads(tmp_path, monkeypatch):
    """The evaluation section's task YAML and its JSON Lines, written where its eval.py command finds them
    (--include-path tasks, run from tmp_path): lm-eval's own task class reads every document, with the
    question as the context, the choices and the label as the data give them."""
    import json

    import yaml
    from lm_eval.api.task import ConfigurableTask

    (task_yaml,) = [body for lang, body in BLOCKS if lang == "yaml" and "dataset_path: json" in body]
    (lines,) = [body for lang, body in BLOCKS if lang == "text" and body.startswith('{"question"')]
    task = yaml.safe_load(task_yaml)
    (command,) = [line for line in BASH_LINES if "--include-path" in line]
    argv = commands(command)[0]
    include, name = argv[argv.index("--include-path") + 1], argv[argv.index("--tasks") + 1]
    assert name == task["task"] and task["dataset_kwargs"]["data_files"]["test"] == f"{include}/{name}.jsonl"
    (tmp_path / include).mkdir()
    (tmp_path / include / f"{name}.yaml").write_text(task_yaml)
    (tmp_path / include / f"{name}.jsonl").write_text(lines)
    monkeypatch.chdir(tmp_path)
    loaded = ConfigurableTask(config=yaml.safe_load((tmp_path / include / f"{name}.yaml").read_text()))
    docs, rows = list(loaded.test_docs()), [json.loads(line) for line in lines.splitlines()]
    assert loaded.OUTPUT_TYPE == "multiple_choice" and len(docs) == len(rows) == 2
    for doc, row in zip(docs, rows):
        assert loaded.doc_to_text(doc) == row["question"] and loaded.doc_to_choice(doc) == row["choices"]
        assert loaded.doc_to_target(doc) == row["label"]


def test_the_peft_snippet_loads_the_adapter(exports, monkeypatch):
    """The LoRA section's snippet, its base (path/to/gpt2) the transformers export of the adapter's base."""
    import peft

    (snippet,) = [body for lang, body in BLOCKS if lang == "python" and "peft" in body]
    monkeypatch.chdir(exports)
    names = {"__name__": "readme_snippet"}
    exec(compile(snippet.replace("path/to/gpt2", "export/default-hf"), "README.md's snippet", "exec"), names)
    assert isinstance(names["model"], peft.PeftModel)
    assert len(peft.get_peft_model_state_dict(names["model"])) == 2 * 2 * 3  # blocks x (A, B) x adapted modules


LIBRARY_NOISE = re.compile(r"^([IWEF]\d{4} |WARNING:|ERROR:|Traceback|Exception )", re.M)  # absl's C++ log, Python's


def test_the_local_bucket_of_the_readme(tmp_path):
    """`python gcs_emulator.py --bucket local`, as the README starts it: the port first (what conftest.py
    and bench_remote.py read), then export lines which, alone, make gs://local reachable from a new shell.
    No library talks there: no line of tensorstore's own log (which credentials it uses) when a checkpoint
    is saved and loaded, none of orbax's when one is damaged (the project says it in one line), and nothing
    on the server's terminal: no traceback when a client hangs up in the middle of a download, no line for
    a read of an object that is not there (a 404, as the service answers)."""
    import gcs_emulator

    server_log = tmp_path / "server.log"
    with open(server_log, "w") as log:
        server = subprocess.Popen([sys.executable, str(REPO / "gcs_emulator.py"), "--bucket", "local"],
                                  stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        port = server.stdout.readline().strip()
        assert port.isdigit()
        lines = [server.stdout.readline().strip() for _ in range(len(gcs_emulator.ENVIRONMENT) + 1)]
        exports = dict(line.removeprefix("export ").split("=", 1) for line in lines if line.startswith("export "))
        assert lines[-1].startswith("# gs://local is ready")
        assert set(exports) == set(gcs_emulator.ENVIRONMENT)  # what the suite's own gs:// paths are reached by
        assert exports["STORAGE_EMULATOR_HOST"] == f"http://127.0.0.1:{port}"
        env = {k: v for k, v in os.environ.items() if k not in exports}  # a shell with only the pasted lines
        code = ("import logging; logging.basicConfig(); "  # libraries' warnings shown, as train.py's logging shows them
                "import gcsfs; fs = gcsfs.GCSFileSystem(); print(fs.ls('local')); "
                "fs.pipe('local/dir/a.txt', b'hello'); print(fs.cat('local/dir/a.txt').decode()); "
                "import numpy as np; from store import rundir; run = rundir.Run('gs://local/run'); "  # orbax, tensorstore's arrays
                "run.weights.save_params({'w': np.arange(3.0)}); print(run.weights.load_params()[0]['w'].tolist()); "
                "fs.rm('local/run/checkpoints/0/_CHECKPOINT_METADATA'); "  # a damaged checkpoint: one line, no noise
                "exec('try: run.weights.load_params()\\nexcept rundir.RunError as e: print(str(e).split(\\': \\', 1)[1])'); "
                "fs.pipe('local/big', bytes(4 << 20))")
        done = subprocess.run([sys.executable, "-c", code], env={**env, **exports, "PYTHONPATH": str(REPO)},
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split("\n")[:3] == ["[]", "hello", "[0.0, 1.0, 2.0]"]
        assert done.stdout.split("\n")[3].startswith("its metadata (_CHECKPOINT_METADATA) is missing or unreadable")
        assert "Authentication failed" not in done.stderr  # no search for credentials the local bucket needs not
        assert LIBRARY_NOISE.findall(done.stderr) == [], done.stderr
        # a client hangs up (a reset) while the server sends it 4 MiB
        with socket.create_connection(("127.0.0.1", int(port))) as client:
            client.sendall(b"GET /storage/v1/b/local/o/big?alt=media HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert client.recv(4096).startswith(b"HTTP/1.")
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        answer = urllib.request.urlopen(f"http://127.0.0.1:{port}/storage/v1/b/local/o/dir%2Fa.txt?alt=media",
                                        timeout=30)
        assert answer.read() == b"hello"  # the server went on
    finally:
        server.kill()
        server.wait(10)
    assert server_log.read_text() == ""  # nothing on the server's terminal but what it printed first


def test_an_undocumented_placeholder_or_tool_fails(monkeypatch):
    """The checker refuses what it cannot vouch for, so a new README command needs a check here."""
    checker = Checker(monkeypatch)
    for line, message in [("python data.py --out gs://NEWBUCKET/x", "look like placeholders"),
                          ("curl https://example.com", "not serve.py's default address"),
                          ("cargo build", "neither checked here nor an allowed"),
                          ("python train.py training.no_such_key=1", "no_such_key"),
                          ("python sample.py --checkpoint runs/x", "prompt"),
                          ("bench/gpu.sh OUT warp", "unknown to bench/gpu.sh")]:
        with pytest.raises(Exception, match=message):
            checker.line(line)


def test_the_preference_snippet_writes_pairs_that_prepare(corpus, tmp_path, monkeypatch):  # noqa: F811
    """The Preference tuning journey's snippet, run as written (in a scratch directory): pairs of this Python's
    stdlib lines that data.py --format preference prepares, every one kept."""
    from tokendata import preference_data

    (snippet,) = [body for lang, body in BLOCKS if lang == "python" and "prefs.jsonl" in body]
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet, "README.md", "exec"), {})
    records = [json.loads(line) for line in (tmp_path / "prefs.jsonl").read_text().splitlines()]
    assert len(records) == 2000 and all(r["prompt"].endswith(" =") and r["chosen"].startswith(" ") for r in records)
    index = preference_data.prepare([str(tmp_path / "prefs.jsonl")], tmp_path / "prefs", seq_len=128,
                                    tokenizer=str(corpus / "tokenizer.json"), progress=False)
    assert index["pairs"] + index["identical"] == 2000 and index["identical"] < 100 and index["skipped_records"] == 0
