"""gs:// paths against a Google Cloud Storage server on 127.0.0.1 (conftest.py's `gcs_server`,
gcs_emulator.py): preparing data into and from a bucket, training with the data and the run directory
in one, exporting and importing there, and a bucket that does not exist; then what a run on a pod meets
in its bucket: a damaged checkpoint, a save the store refuses, SIGTERM and SIGKILL, and the tools that
read the run, write beside it and start from it.
"""
import collections
import gzip
import hashlib
import json
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import time
import uuid

import fsspec
import jax
import numpy as np
import pytest

import convert_torch
import data
import train
from conftest import uncached_env
from core import json_log, outputs, storage
from core.errors import RunError
from store import rundir, runlock
from test_train import WORDS, deterministic, tiny
from tokendata import shards

REPO = pathlib.Path(__file__).resolve().parent


def store():
    """A view of the server that caches no listing: it sees what other processes wrote."""
    return fsspec.filesystem("gs", skip_instance_cache=True, use_listings_cache=False)


def test_the_server_keeps_generations_and_their_preconditions(gcs_bucket):
    """What tensorstore (orbax's arrays) relies on: every read says the generation it read, and a write or
    read conditioned on a generation is refused when the object is not (or is) that generation."""
    import tensorstore as ts

    kv = ts.KvStore.open({"driver": "gcs", "bucket": gcs_bucket.removeprefix("gs://")}).result()
    first = kv.write("a", b"one").result().generation
    read = kv.read("a").result()
    assert (read.state, read.value, read.stamp.generation) == ("value", b"one", first)
    second = kv.write("a", b"two", if_equal=first).result().generation  # the generation it was: done
    assert second not in (first, b"")
    refused = kv.write("a", b"three", if_equal=first).result()  # no longer that generation: 412, nothing written
    assert refused.generation == b"" and kv.read("a").result().value == b"two"
    unchanged = kv.read("a", if_not_equal=second).result()  # 304: the reader's copy is current
    assert unchanged.state == "unspecified" and unchanged.value == b""
    assert store().cat_file(f"{gcs_bucket}/a") == b"two"  # gcsfs sees the same object


# ----------------------------------------------------------------------------------------------
# Data directories: prepared into a bucket, from one, verified there


def write_corpus(directory: pathlib.Path, documents: int = 30) -> pathlib.Path:
    """Word-salad text files doc00.txt ..., and one JSON Lines file (gzip) with a few records."""
    directory.mkdir(parents=True)
    for i in range(documents):
        rng = random.Random(i)
        (directory / f"doc{i:02d}.txt").write_text(
            "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 12))) for _ in range(40)) + "\n")
    records = [{"text": " ".join(random.Random(-i).choices(WORDS, k=30))} for i in range(1, 6)]
    (directory / "more.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode()))
    return directory


def upload(local: pathlib.Path, url: str) -> None:
    fs = store()
    for path in sorted(local.iterdir()):
        fs.pipe_file(f"{url}/{path.name}", path.read_bytes())


def remote_files(url: str) -> dict[str, bytes]:
    """Every object under url (recursively), by its name relative to url."""
    fs, root = store(), url.removeprefix("gs://")
    return {path[len(root) + 1:]: fs.cat_file(path) for path in sorted(fs.find(root))}


def local_files(directory: pathlib.Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


PREPARE = ["--vocab-size", "300", "--val-fraction", "0.3", "--shard-tokens", "1500", "--workers", "1"]


def data_cli(*args, capsys) -> tuple[int, list[str]]:
    """data.py in this process: (exit status, the lines on stderr)."""
    capsys.readouterr()
    status = data.cli([str(a) for a in args])
    return status, capsys.readouterr().err.strip().splitlines()


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> pathlib.Path:
    return write_corpus(tmp_path_factory.mktemp("gcs-corpus") / "src")


def test_inputs_in_a_bucket_are_globbed_and_read_like_local_files(corpus_dir, gcs_bucket, tmp_path, capsys):
    """--input 'gs://BUCKET/corpus/*.txt': the same documents, named the same (so the same held out), as
    the local files the objects were copied from give: the same directory but for the inputs it records."""
    upload(corpus_dir, f"{gcs_bucket}/corpus")
    store().pipe_file(f"{gcs_bucket}/corpus/notes.md", b"not matched by either pattern\n")
    patterns = ["*.txt", "*.jsonl.gz"]
    remote, local = tmp_path / "from-bucket", tmp_path / "from-disk"
    status, err = data_cli(*(a for p in patterns for a in ("--input", f"{gcs_bucket}/corpus/{p}")),
                           "--out", remote, *PREPARE, capsys=capsys)
    assert (status, err) == (0, [])
    assert data.cli([*(a for p in patterns for a in ("--input", str(corpus_dir / p))), "--out", str(local),
                     *PREPARE]) == 0
    a, b = local_files(remote), local_files(local)
    index_a, index_b = json.loads(a.pop("index.json")), json.loads(b.pop("index.json"))
    assert a == b  # tokenizer and every shard, byte for byte
    assert index_a["inputs"] == [f"{gcs_bucket}/corpus/{p}" for p in patterns]
    assert {k: v for k, v in index_a.items() if k != "inputs"} == {k: v for k, v in index_b.items() if k != "inputs"}
    assert index_a["documents"] == 30 + 5 and index_a["splits"]["val"]["documents"] > 0


def test_data_py_writes_into_a_bucket_by_the_rules_of_a_local_out(corpus_dir, gcs_bucket, tmp_path, capsys,
                                                                    monkeypatch):
    """--out gs://...: the directory a local --out gets, in the bucket (nothing on the local disk); an
    existing one is replaced only with --overwrite, and only a data directory or an empty one."""
    monkeypatch.chdir(tmp_path)
    url = f"{gcs_bucket}/data"
    local = tmp_path / "local"
    assert data.cli(["--input", str(corpus_dir), "--out", str(local), *PREPARE]) == 0
    assert data_cli("--input", corpus_dir, "--out", url, *PREPARE, capsys=capsys) == (0, [])
    assert remote_files(url) == local_files(local)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["local"]  # no ./gs:/... beside it

    # not again without --overwrite; with it, a data directory is replaced whole (fewer, larger shards)
    status, err = data_cli("--input", corpus_dir, "--out", url, *PREPARE, capsys=capsys)
    assert status == 2 and err == [f"error: {url} exists; pass --overwrite to replace it"]
    assert remote_files(url) == local_files(local)
    bigger = [*PREPARE[:-4], "--shard-tokens", "4000", "--workers", "1"]
    assert data.cli(["--input", str(corpus_dir), "--out", str(tmp_path / "bigger"), *bigger]) == 0
    assert data_cli("--input", corpus_dir, "--out", url, *bigger, "--overwrite", capsys=capsys) == (0, [])
    assert remote_files(url) == local_files(tmp_path / "bigger")  # the old shards gone with the old index

    # what is not a data directory stays, --overwrite or not; so does a whole bucket
    store().pipe_file(f"{gcs_bucket}/notes/todo.txt", b"mine\n")
    status, err = data_cli("--input", corpus_dir, "--out", f"{gcs_bucket}/notes", *PREPARE, "--overwrite",
                           capsys=capsys)
    assert status == 2 and len(err) == 1
    assert err[0].startswith(f"error: --out {gcs_bucket}/notes holds todo.txt and is not a data directory")
    status, err = data_cli("--input", corpus_dir, "--out", gcs_bucket, *PREPARE, "--overwrite", capsys=capsys)
    assert status == 2 and len(err) == 1 and "whole bucket" in err[0]
    assert remote_files(f"{gcs_bucket}/notes") == {"todo.txt": b"mine\n"}
    assert remote_files(url) == local_files(tmp_path / "bigger")


def test_an_upload_cut_short_leaves_no_directory_a_reader_takes_for_complete(corpus_dir, gcs_bucket, tmp_path,
                                                                             capsys, monkeypatch):
    """The files go up before index.json: when the upload stops half way (a dropped connection here; a kill
    stops at the same point), the directory has no index.json, a reader refuses it, and the next run
    with --overwrite replaces it."""
    url = f"{gcs_bucket}/data"
    real, sent = outputs.upload_file, []

    def drops_after_two(fs, local, remote):
        if len(sent) == 2:
            raise ConnectionResetError("Connection reset by peer")
        sent.append(remote)
        real(fs, local, remote)

    monkeypatch.setattr(outputs, "upload_file", drops_after_two)
    status, err = data_cli("--input", corpus_dir, "--out", url, *PREPARE, capsys=capsys)
    assert status == 2 and err == [f"error: cannot write {url}: Connection reset by peer"]
    left = remote_files(url)
    assert "index.json" not in left and len([n for n in left if n.endswith(".bin")]) >= 1
    with pytest.raises(data.DataError, match=rf"{url}/index.json not found"):
        shards.open_data(url).index
    monkeypatch.setattr(outputs, "upload_file", real)
    status, err = data_cli("--input", corpus_dir, "--out", url, *PREPARE, capsys=capsys)
    assert status == 2 and err == [f"error: {url} exists; pass --overwrite to replace it"]
    assert data_cli("--input", corpus_dir, "--out", url, *PREPARE, "--overwrite", capsys=capsys) == (0, [])
    assert data.cli(["--input", str(corpus_dir), "--out", str(tmp_path / "local"), *PREPARE]) == 0
    assert remote_files(url) == local_files(tmp_path / "local")


def test_verify_reads_a_bucket_in_place(corpus_dir, gcs_bucket, tmp_path, capsys):
    """--verify gs://...: every file hashed as it streams from the bucket, nothing copied to the local disk;
    a changed byte named by its URL."""
    local = tmp_path / "local"
    assert data.cli(["--input", str(corpus_dir), "--out", str(local), *PREPARE]) == 0
    url = f"{gcs_bucket}/data"
    upload(local, url)
    index = json.loads((local / "index.json").read_text())
    status, err = data_cli("--verify", url, capsys=capsys)
    assert (status, err) == (0, [])
    name = index["splits"]["train"]["shards"][1]["file"]
    raw = bytearray((local / name).read_bytes())
    raw[7] ^= 1
    store().pipe_file(f"{url}/{name}", bytes(raw))
    capsys.readouterr()
    assert data.cli(["--verify", url]) == 2
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"{url}/{name}: sha256 {hashlib.sha256(raw).hexdigest()[:16]}..., index.json "
                                f"records {index['splits']['train']['shards'][1]['sha256'][:16]}...: changed"]
    assert err.startswith(f"error: {url}: 1 of ")


# ----------------------------------------------------------------------------------------------
# A bucket that does not exist: one line naming it, from every command that reads or writes one


def test_a_bucket_that_does_not_exist_is_named(corpus_dir, gcs_server, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bucket = f"missing-{uuid.uuid4().hex[:8]}"
    said = f"bucket '{bucket}' does not exist"

    def one_line(status, err):
        assert status == 2 and len(err) == 1 and err[0].startswith("error: ") and said in err[0], err

    one_line(*data_cli("--input", f"gs://{bucket}/corpus/*.txt", "--out", tmp_path / "d", capsys=capsys))
    one_line(*data_cli("--input", corpus_dir, "--out", f"gs://{bucket}/data", *PREPARE, capsys=capsys))
    one_line(*data_cli("--verify", f"gs://{bucket}/data", capsys=capsys))
    capsys.readouterr()
    one_line(train.cli(tiny(tmp_path / "run", f"gs://{bucket}/data")), capsys.readouterr().err.strip().splitlines())
    local = tmp_path / "local"
    assert data.cli(["--input", str(corpus_dir), "--out", str(local), *PREPARE]) == 0
    capsys.readouterr()
    one_line(train.cli(tiny(f"gs://{bucket}/run", local)), capsys.readouterr().err.strip().splitlines())
    one_line(convert_torch.cli(["--checkpoint", str(tmp_path / "run"), "--out", f"gs://{bucket}/export"]),
             capsys.readouterr().err.strip().splitlines())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["local"]  # nothing written anywhere else


def test_a_file_in_a_bucket_given_as_the_data_says_the_command_that_prepares_it(gcs_bucket):
    """An object, not a prepared directory, as the data: the line a local file gets, with its URL."""
    store().pipe(f"{gcs_bucket}/pairs.jsonl", b'{"in_text": "a b", "out_text": " c"}\n')
    with pytest.raises(shards.DataError) as e:
        shards.open_data(f"{gcs_bucket}/pairs.jsonl")
    assert str(e.value) == (
        f"{gcs_bucket}/pairs.jsonl is a file, not a prepared data directory: data.py prepares it into one (`python "
        f"data.py --format prompt_completion --input {gcs_bucket}/pairs.jsonl --out data/pairs --tokenizer RUN_DIR "
        f"--seq-len T`: RUN_DIR the run it fine-tunes, whose tokenizer the pairs need, T the context it trains at); "
        f"then give that directory (data/pairs) instead")


# ----------------------------------------------------------------------------------------------
# A run in a bucket, from data prepared there, resumed there, exported and imported there


@pytest.fixture(scope="module")
def journey(corpus_dir, gcs_module_bucket, tmp_path_factory):
    """`python data.py` prepares the corpus into the bucket; a tiny run trains 8 steps with data.dir and
    run_dir there; then, as if it had been stopped after its checkpoint at step 4, `python train.py
    --resume` continues it. Returns (bucket, the straight run's metrics rows, its step-8 parameters, the
    working directory the commands ran in)."""
    bucket, cwd = gcs_module_bucket, tmp_path_factory.mktemp("journey")
    done = subprocess.run([sys.executable, str(REPO / "data.py"), "--input", str(corpus_dir), "--out",
                           f"{bucket}/data", *PREPARE], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    run = f"{bucket}/run"
    assert train.main(tiny(run, f"{bucket}/data")) == 0
    straight = metrics(run)
    params, step = rundir.Run(run).weights.load_params()
    assert step == 8
    fs = store()
    fs.rm(f"{run.removeprefix('gs://')}/checkpoints/8", recursive=True)
    fs.rm_file(f"{run.removeprefix('gs://')}/summary.json")
    # the resume as a shell without FSSPEC_GCS_TOKEN runs it (gcsfs then searches for default credentials
    # before it goes on anonymously): google-auth's notes of that search are no lines of the run's
    env = {k: v for k, v in os.environ.items() if k != "FSSPEC_GCS_TOKEN"}
    done = subprocess.run([sys.executable, str(REPO / "train.py"), "--resume", f"run_dir={run}"], cwd=cwd,
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "google.auth" not in done.stderr and "Authentication failed" not in done.stderr, done.stderr
    return bucket, straight, params, cwd


def metrics(run: str) -> list[dict]:
    return [json.loads(line) for line in store().cat_file(f"{run}/metrics.jsonl").decode().splitlines()]


def test_a_run_in_a_bucket_resumes_exactly(journey, corpus_dir, tmp_path):
    """Steps 5..8 after the resume equal the straight run's, and so do its step-8 parameters; every file of
    the run, its checkpoints too, is in the bucket, and nothing is written beside the commands."""
    bucket, straight, params, cwd = journey
    run = f"{bucket}/run"
    assert [r["step"] for r in straight] == list(range(1, 9))
    assert [deterministic(r) for r in metrics(run)] == [deterministic(r) for r in straight]
    resumed, step = rundir.Run(run).weights.load_params()
    assert step == 8
    jax.tree.map(np.testing.assert_array_equal, resumed, params)
    names = set(remote_files(run))
    assert {"config.yaml", "data.json", "tokenizer.json", "metrics.jsonl", "summary.json"} <= names
    assert {name.split("/")[1] for name in names if name.startswith("checkpoints/")} == {"4", "8"}
    assert json.loads(store().cat_file(f"{run}/summary.json"))["steps"] == 8
    assert list(cwd.iterdir()) == []
    local = tmp_path / "local"  # the data in the bucket is what data.py writes to a local --out
    assert data.cli(["--input", str(corpus_dir), "--out", str(local), *PREPARE]) == 0
    assert remote_files(f"{bucket}/data") == local_files(local)


def test_an_export_into_a_bucket_is_the_local_export(journey, tmp_path, capsys):
    bucket = journey[0]
    for fmt in ("torch", "hf"):
        url = f"{bucket}/export-{fmt}"
        capsys.readouterr()
        assert convert_torch.main(["--checkpoint", f"{bucket}/run", "--out", url, "--format", fmt]) == 0
        assert capsys.readouterr().out.startswith(f"wrote step 8 of {bucket}/run to {url};")
        assert convert_torch.main(["--checkpoint", f"{bucket}/run", "--out", str(tmp_path / fmt), "--format",
                                   fmt]) == 0
        assert remote_files(url) == local_files(tmp_path / fmt)
    assert not (pathlib.Path.cwd() / "gs:").exists()


def test_an_import_into_a_bucket_is_a_run_directory_there(journey, tmp_path, capsys):
    """--import-hf DIR --out gs://...: the run directory the local import writes, in the bucket, read back
    by the run directory's own reader; and like a local one, not replaced without --overwrite."""
    bucket = journey[0]
    hf = tmp_path / "hf"
    assert convert_torch.main(["--checkpoint", f"{bucket}/run", "--out", str(hf), "--format", "hf"]) == 0
    url, local = f"{bucket}/imported", tmp_path / "imported"
    assert convert_torch.main(["--import-hf", str(hf), "--out", url]) == 0
    assert f"imported {hf} into run directory {url} (step 0)" in capsys.readouterr().out
    assert convert_torch.main(["--import-hf", str(hf), "--out", str(local)]) == 0
    remote, there = rundir.Run(url), rundir.Run(local)
    assert remote.record.config().run_dir == url
    assert remote.record.config().model == there.record.config().model
    assert remote.dir.read_bytes("tokenizer.json") == (local / "tokenizer.json").read_bytes()
    (a, step_a), (b, step_b) = remote.weights.load_params(), there.weights.load_params()
    assert step_a == step_b == 0
    jax.tree.map(np.testing.assert_array_equal, a, b)
    assert convert_torch.cli(["--import-hf", str(hf), "--out", url]) == 2
    assert capsys.readouterr().err.strip() == f"error: {url} already exists; choose another --out or pass --overwrite"


# ----------------------------------------------------------------------------------------------
# What a pod run meets in a bucket: a damaged checkpoint, a save refused, a kill, the tools after it


def copy_run(journey, name: str) -> str:
    """A copy of the journey's finished run (checkpoints 4 and 8) at BUCKET/name, copied inside the bucket."""
    bucket = journey[0]
    fs, src, dst = store(), f"{bucket}/run".removeprefix("gs://"), f"{bucket}/{name}".removeprefix("gs://")
    for path in fs.find(src):
        fs.copy(path, dst + path[len(src):])
    return f"{bucket}/{name}"


def test_a_damaged_checkpoint_in_a_bucket_is_moved_aside_and_the_run_resumes(journey, capsys):
    """As on a local disk (test_train's damaged-checkpoint test): every array object of checkpoint 8
    truncated, --resume says so in one message, moves it whole to RUN/checkpoints-damaged/8 in the bucket,
    resumes from 4 and ends as the straight run did; and it has left nothing that trips a later resume."""
    bucket, straight, params, _ = journey
    run = copy_run(journey, "damaged")
    fs, root = store(), run.removeprefix("gs://")
    damaged = {}
    for path in fs.find(f"{root}/checkpoints/8"):
        if "METADATA" not in path.rsplit("/", 1)[-1] and fs.size(path) > 0:
            fs.pipe_file(path, b"\0" * 7)
        damaged[path[len(root) + len("/checkpoints/8/"):]] = fs.cat_file(path)
    capsys.readouterr()
    assert train.main(["--resume", f"run_dir={run}"]) == 0
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "cannot be restored" in line]
    assert len(said) == 1, out
    assert said[0].startswith("checkpoint 8 cannot be restored (8: array ") and " cannot be read (" in said[0]
    assert said[0].endswith(f"; moved to {run}/checkpoints-damaged; resuming from checkpoint 4, the newest intact one")
    assert "TensorStore" not in out and "<bound method" not in out
    assert remote_files(f"{run}/checkpoints-damaged") == {f"8/{name}": raw for name, raw in damaged.items()}
    assert [deterministic(r) for r in metrics(run)] == [deterministic(r) for r in straight]
    resumed, step = rundir.Run(run).weights.load_params()
    assert step == 8
    jax.tree.map(np.testing.assert_array_equal, resumed, params)
    assert {name.split("/")[1] for name in remote_files(run) if name.startswith("checkpoints/")} == {"4", "8"}


@pytest.mark.parametrize("where", ["local", "bucket"])
def test_a_step_damaged_twice_keeps_both(where, gcs_bucket, tmp_path):
    """A checkpoint moved aside when one of its step already lies in checkpoints-damaged/ (damaged again
    after a resume saved it anew) goes beside it as <step>.1: both kept, byte for byte, locally and in a
    bucket alike."""
    files = {"checkpoints/8/a": b"second", "checkpoints/8/d/b": b"second b", "checkpoints/4/a": b"intact",
             "checkpoints-damaged/8/a": b"first"}
    if where == "local":
        location = tmp_path / "run"
        for name, raw in files.items():
            (location / name).parent.mkdir(parents=True, exist_ok=True)
            (location / name).write_bytes(raw)
        listing = lambda: local_files(location)  # noqa: E731
    else:
        location = f"{gcs_bucket}/run"
        for name, raw in files.items():
            store().pipe_file(f"{location}/{name}", raw)
        listing = lambda: remote_files(location)  # noqa: E731
    assert rundir.Run(location).checkpoints.write().move_aside(8) == "8.1"
    assert listing() == {"checkpoints/4/a": b"intact", "checkpoints-damaged/8/a": b"first",
                         "checkpoints-damaged/8.1/a": b"second", "checkpoints-damaged/8.1/d/b": b"second b"}


def orbax_restore(run: str, step: int):
    """The raw checkpointed state at `step` of a run in the bucket, read by orbax directly."""
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(f"{run}/checkpoints") as mngr:
        return mngr.restore(step, args=ocp.args.StandardRestore())


def test_a_save_the_bucket_refuses_stops_the_run_with_one_line(journey, gcs_refusals, capsys):
    """The bucket refuses the writes of checkpoint 8 (access withdrawn; async save, as by default): the run
    stops with one line giving the reason and the newest complete checkpoint, 4, which stays as saved;
    with access back, --resume ends as the straight run did."""
    bucket, straight, params, _ = journey
    run = copy_run(journey, "refused")
    fs, root = store(), run.removeprefix("gs://")
    fs.rm(f"{root}/checkpoints/8", recursive=True)
    fs.rm_file(f"{root}/summary.json")
    gcs_refusals(f"{run}/checkpoints/8/default")  # the arrays: the save writes other files first
    capsys.readouterr()
    assert train.cli(["--resume", f"run_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert gcs_refusals.refused() >= 1
    progress = re.compile(r"train:|step \d+/\d+: ")  # the progress bar, or its plain lines where stderr is no terminal
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip() and not progress.match(line)]
    assert lines == [f"error: saving checkpoint 8 in {run}/checkpoints failed (HTTP 403: test@example.com does not "
                     f"have storage.objects.create access to the Google Cloud Storage object); the newest "
                     f"complete checkpoint is 4: fix the cause, then continue with --resume"], err
    assert {name.split("/")[1] for name in remote_files(run) if name.startswith("checkpoints/")} == {"4"}
    jax.tree.map(np.testing.assert_array_equal, orbax_restore(run, 4), orbax_restore(f"{bucket}/run", 4))
    gcs_refusals.lift()
    assert train.main(["--resume", f"run_dir={run}"]) == 0
    assert [deterministic(r) for r in metrics(run)] == [deterministic(r) for r in straight]
    resumed, step = rundir.Run(run).weights.load_params()
    assert step == 8
    jax.tree.map(np.testing.assert_array_equal, resumed, params)


def checkpoints(run: str) -> list[int]:
    """The complete checkpoints of a run in the bucket: in a bucket orbax marks a step's directory
    complete with commit_success.txt, written last."""
    names = store().find(f"{run.removeprefix('gs://')}/checkpoints", maxdepth=2)
    return sorted(int(n.split("/")[-2]) for n in names if n.endswith("/commit_success.txt"))


def test_a_run_in_a_bucket_stopped_by_sigterm_then_killed_resumes_exactly(journey, gcs_refusals, capsys,
                                                                          monkeypatch):
    """`python train.py` with data and run directory in the bucket: SIGTERM while its first step compiles
    (start-up: it exits 143 at once and removes what it wrote, leaving nothing in the bucket); a run of
    one step (checkpoint 1); `--resume training.steps=8`, killed with SIGKILL while it saves checkpoint
    8 (its commit marker held back by a busy store), which leaves the lease it held and checkpoint 8
    written but not committed; `--resume` waits out the lease (GPT_LEASE_TTL=8 s), resumes from
    checkpoint 4 and ends with the straight run's metrics and parameters."""
    bucket, straight, params, cwd = journey
    run = f"{bucket}/killed"
    ttl = 8  # seconds: the lease is renewed every 8/6 s, and a holder two renewals late is taken for dead
    env = {**os.environ, "PYTHONUNBUFFERED": "1", runlock.LEASE_TTL_ENV: str(ttl)}
    command = [sys.executable, str(REPO / "train.py")]

    first = subprocess.Popen([*command, *tiny(run, f"{bucket}/data")], cwd=cwd, env=uncached_env(**env),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # its first step compiles
    for line in first.stdout:  # printed as the loop starts: the first step (and its compilation) is under way
        if line.startswith("model test:"):
            break
    first.send_signal(signal.SIGTERM)
    out, err = first.communicate(timeout=120)
    assert first.returncode == 128 + signal.SIGTERM, err
    assert f"stopped by SIGTERM during start-up: nothing trained, nothing saved; removed the run directory {run}" \
        in out and "Traceback" not in err
    assert store().find(run.removeprefix("gs://")) == []  # the same command starts afresh
    done = subprocess.run([*command, *tiny(run, f"{bucket}/data"), "training.steps=1"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert checkpoints(run) == [1]

    gcs_refusals(f"{run}/checkpoints/8/commit_success.txt", status=503)
    second = subprocess.Popen([*command, "--resume", f"run_dir={run}", "training.steps=8"], cwd=cwd, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while gcs_refusals.refused() == 0 and second.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert second.poll() is None, second.communicate()[1]  # still saving checkpoint 8
        assert gcs_refusals.refused() > 0
        second.kill()
        second.wait(timeout=60)
    finally:
        second.kill()
        second.communicate()
    assert second.returncode == -signal.SIGKILL
    gcs_refusals.lift()
    left = remote_files(run)
    lease = json.loads(left[runlock.LOCK])
    assert lease["pid"] == second.pid and lease["purpose"] == "train.py --resume"
    assert "checkpoints/8/commit_success.txt" not in left and any(n.startswith("checkpoints/8/") for n in left)
    assert checkpoints(run) == [1, 4]

    monkeypatch.setenv(runlock.LEASE_TTL_ENV, str(ttl))
    while time.time() - lease["heartbeat"] < 2 * ttl / 6 + 0.2:  # no longer renewed as a live holder's is
        time.sleep(0.1)
    capsys.readouterr()
    assert train.main(["--resume", f"run_dir={run}"]) == 0
    out = capsys.readouterr().out
    assert f"held by train.py --resume (pid {second.pid} on " in out and "waiting up to" in out
    assert "cannot be restored" not in out and "resuming from step 4" in out
    got = [deterministic(r) for r in metrics(run)]
    for key in ("val_loss", "val_ppl"):  # the one-step run evaluated at its end, its last step
        got[0].pop(key)
    assert got == [deterministic(r) for r in straight]
    assert checkpoints(run) == [1, 4, 8]
    resumed, step = rundir.Run(run).weights.load_params()
    assert step == 8
    jax.tree.map(np.testing.assert_array_equal, resumed, params)
    assert runlock.LOCK not in remote_files(run)  # released


def test_a_start_and_a_resume_download_the_index_and_tokenizer_once(corpus_dir, gcs_server, gcs_bucket, tmp_path,
                                                                    capsys):
    """A data directory in a bucket is opened once per process: a training start and a resume each download
    index.json and tokenizer.json once, as the server's request log counts them."""
    import urllib.request

    def downloads() -> collections.Counter:
        with urllib.request.urlopen(f"{gcs_server}/_emulator/requests") as answer:
            seen = json.loads(answer.read())
        return collections.Counter(r["object"] for r in seen if r["media"] and r["bucket"] == gcs_bucket[5:])

    def forget() -> None:
        urllib.request.urlopen(urllib.request.Request(f"{gcs_server}/_emulator/requests", method="DELETE")).read()

    assert data.cli(["--input", str(corpus_dir), "--out", f"{gcs_bucket}/data", *PREPARE]) == 0
    run = tmp_path / "run"
    for args in (tiny(run, f"{gcs_bucket}/data", "training.steps=2", "checkpoint.every=2", "training.eval_every=2"),
                 ["--resume", f"run_dir={run}", "training.steps=4"]):
        forget()
        assert train.main(args) == 0
        got = downloads()
        assert (got["data/index.json"], got["data/tokenizer.json"]) == (1, 1), args
        assert got["data/" + shards.open_data(f"{gcs_bucket}/data").splits["train"]["shards"][0]["file"]] >= 1
    capsys.readouterr()


def test_the_tools_read_and_write_a_run_in_the_bucket(journey, tmp_path, capsys, monkeypatch):
    """On the journey's run in the bucket, each tool does what it does on a local copy of the run: sample.py
    prints the same text; eval.py scores the same and writes its results into the bucket (nothing beside
    the command); training.init_from=gs://... starts from its parameters (a step at learning rate 0 keeps
    them exactly); convert_torch.py --import-hf reads a transformers export in the bucket as its local copy."""
    bucket, _, params, _ = journey
    run, local = f"{bucket}/run", tmp_path / "run"
    for name, raw in remote_files(run).items():
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(raw)
    monkeypatch.chdir(tmp_path)

    def command(tool, *args) -> str:
        capsys.readouterr()
        assert tool.cli([str(a) for a in args]) == 0
        return capsys.readouterr().out

    sample_args = ["--prompt", "the cat", "--temperature", "0.8", "--seed", "3", "--num-samples", "2",
                   "--max-new-tokens", "12"]
    import sample
    assert command(sample, "--checkpoint", run, *sample_args) == command(sample, "--checkpoint", local, *sample_args)

    import eval as eval_lib
    eval_args = ["--lengths", "1x,2x", "--max-tokens", "3000"]
    said = command(eval_lib, "--checkpoint", run, *eval_args)
    assert f"-> {run}/eval/step8.json: lengths 32, 64 written" in said
    command(eval_lib, "--checkpoint", local, *eval_args)
    written = remote_files(f"{run}/eval")
    there, here = json.loads(written["step8.json"]), json.loads((local / "eval" / "step8.json").read_text())
    assert there.pop("updated") and here.pop("updated")  # when each was written
    assert there == here and [r["length"] for r in there["perplexity"]["rows"]] == [32, 64]
    assert written["step8-perplexity.png"].startswith(b"\x89PNG")

    tuned = f"{bucket}/tuned"
    assert train.main(tiny(tuned, f"{bucket}/data", f"training.init_from={run}", "training.steps=1",
                           "training.lr=0", "training.min_lr=0")) == 0
    assert f"parameters from {run}" in capsys.readouterr().out
    started, step = rundir.Run(tuned).weights.load_params()
    assert step == 1
    jax.tree.map(np.testing.assert_array_equal, started, params)

    hf, exported = f"{bucket}/export-hf-for-import", tmp_path / "hf"
    assert convert_torch.main(["--checkpoint", run, "--out", hf, "--format", "hf"]) == 0
    assert convert_torch.main(["--checkpoint", run, "--out", str(exported), "--format", "hf"]) == 0
    said = command(convert_torch, "--import-hf", hf, "--out", tmp_path / "from-bucket")
    assert f"imported {hf} into run directory {tmp_path / 'from-bucket'} (step 0)" in said
    command(convert_torch, "--import-hf", exported, "--out", tmp_path / "from-disk")
    a, b = rundir.Run(tmp_path / "from-bucket"), rundir.Run(tmp_path / "from-disk")
    assert a.record.config().model == b.record.config().model
    assert a.dir.read_bytes("tokenizer.json") == b.dir.read_bytes("tokenizer.json") == local_files(local)["tokenizer.json"]
    jax.tree.map(np.testing.assert_array_equal, a.weights.load_params()[0], b.weights.load_params()[0])
    capsys.readouterr()
    assert convert_torch.cli(["--import-hf", f"{bucket}/no-such-model", "--out", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err == (f"error: {bucket}/no-such-model is not a transformers checkpoint "
                                       f"directory: no config.json\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["from-bucket", "from-disk", "hf", "run"]


@pytest.mark.parametrize("value", ["soon", "5", "nan"])
def test_a_lease_time_that_is_not_one_is_one_line(value, journey, capsys, monkeypatch):
    """GPT_LEASE_TTL must be a number of seconds, at least 6: anything else stops a run in a bucket with one
    line naming it, before the run directory is touched."""
    run = f"{journey[0]}/run"
    before = remote_files(run)
    monkeypatch.setenv(runlock.LEASE_TTL_ENV, value)
    capsys.readouterr()
    assert train.cli(["--resume", f"run_dir={run}", "training.steps=9"]) == 2
    assert capsys.readouterr().err == (f"error: GPT_LEASE_TTL={value}: the seconds a run directory's lease in a bucket "
                                       f"lasts, a number of at least 6 (it is renewed every sixth of them); unset, 60\n")
    assert remote_files(run) == before


def test_a_paused_holder_that_lost_its_lease_writes_nothing_more(journey, capsys):
    """The holder of a run in the bucket is paused (SIGSTOP: a VM stall, a closed laptop lid) past its
    lease; `--resume` takes the lease (one conditional write) and trains on. When the first is resumed
    (SIGCONT) it finds, before its next write, that the lease is no longer its own, and stops with one
    line: only the second writes into the run, which ends with every step logged once."""
    bucket, _, _, cwd = journey
    run = f"{bucket}/paused"
    ttl = 6  # seconds: renewed every second
    env = {**os.environ, "PYTHONUNBUFFERED": "1", runlock.LEASE_TTL_ENV: str(ttl)}
    command = [sys.executable, str(REPO / "train.py")]
    args = tiny(run, f"{bucket}/data", "training.steps=24", "checkpoint.every=4", "training.eval_every=4")
    first = subprocess.Popen([*command, *args], cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 180
        while checkpoints(run) == [] and first.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert first.poll() is None, first.communicate()[1]
        first.send_signal(signal.SIGSTOP)
        time.sleep(ttl + 1)  # its heartbeat is older than the lease
        second = subprocess.run([*command, "--resume", f"run_dir={run}"], cwd=cwd, env=env, capture_output=True,
                                text=True, timeout=300)
        assert second.returncode == 0, second.stdout + second.stderr
        first.send_signal(signal.SIGCONT)
        _, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 2, err
    last = err.strip().splitlines()[-1]  # after the progress bar and the auth library's warnings
    assert last.startswith(f"error: this process lost the lease on {run} (") and "Traceback" not in err, err
    steps = [r["step"] for r in metrics(run)]
    assert steps == list(range(1, 25))  # each step once: nothing of the first after the takeover
    assert json.loads(store().cat_file(f"{run}/summary.json"))["steps"] == 24
    assert runlock.LOCK not in remote_files(run)


def test_a_log_upload_after_the_run_was_taken_does_not_replace_the_new_holders(gcs_bucket):
    """A holder paused between the run's fence and its upload of metrics.jsonl (which an object store
    replaces whole) must not put its rows back over those of the process that took the run meanwhile:
    each upload is conditional on the generation the holder wrote last, and a replaced file stops it."""
    run = storage.RunDir(f"{gcs_bucket}/taken")
    first = json_log.JsonLines(run, "metrics.jsonl")
    for step in (1, 2, 3):
        first.append({"step": step})
    first.flush()
    second = json_log.JsonLines(run, "metrics.jsonl", keep=lambda row: row["step"] <= 2)  # resumed from step 2
    second.append({"step": 3, "by": "second"})
    second.flush()
    first.append({"step": 4})
    with pytest.raises(storage.StorageError, match="metrics.jsonl was replaced by another process meanwhile"):
        first.flush()
    assert [json.loads(line) for line in run.read_text("metrics.jsonl").splitlines()] == [
        {"step": 1}, {"step": 2}, {"step": 3, "by": "second"}]


def test_a_log_upload_retried_or_overtaken_at_start_goes_on(gcs_bucket, monkeypatch):
    """What is no takeover does not stop the run: an upload of metrics.jsonl whose answer was lost, retried by
    the client and refused (412) because our own write is there, is taken as written; and a stale writer's
    upload landing between the new holder's read of the log and its first write makes the new holder read
    it again (dropping the rows past its step) rather than stop."""
    run = storage.RunDir(f"{gcs_bucket}/retried")
    real_write, real_read = storage.Versions.write_if, storage.Versions.versioned
    log = json_log.JsonLines(run, "metrics.jsonl")
    log.append({"step": 1})

    def retried(self, name, content, generation):
        real_write(self, name, content, generation)  # stored, but the answer lost: the retry finds it there
        monkeypatch.setattr(storage.Versions, "write_if", real_write)
        raise storage.Conflict(name)

    monkeypatch.setattr(storage.Versions, "write_if", retried)
    log.flush()
    log.append({"step": 2})
    log.flush()
    assert run.read_text("metrics.jsonl") == '{"step": 1}\n{"step": 2}\n'

    def overtaken(self, name):
        read = real_read(self, name)
        monkeypatch.setattr(storage.Versions, "versioned", real_read)
        run.write_text(name, '{"step": 1}\n{"step": 2}\n{"step": 3, "by": "stale"}\n')  # lands after our read
        return read

    monkeypatch.setattr(storage.Versions, "versioned", overtaken)
    resumed = json_log.JsonLines(run, "metrics.jsonl", keep=lambda row: row["step"] <= 2)
    resumed.append({"step": 3})
    resumed.flush()
    assert run.read_text("metrics.jsonl") == '{"step": 1}\n{"step": 2}\n{"step": 3}\n'


@pytest.mark.parametrize("late_write", ["take", "renewal"])
def test_a_lease_write_answered_after_a_pause_does_not_extend_the_lease(late_write, gcs_bucket, monkeypatch):
    """A lease write (its taking, or a renewal) whose answer comes back only after a pause (the process stopped
    with its request in flight) during which another process took the run, counts from when it was sent: the
    fence then looks at the lock again and stops the holder, rather than trusting the late answer for two
    more renewal periods."""
    every = 0.1  # seconds between renewals: the fence looks again once none went through for 0.2 s
    monkeypatch.setattr(runlock, "lease_times", lambda: (6.0, every))
    monkeypatch.setattr(runlock.Lease, "start", lambda self: None)  # no renewal thread: only the writes below
    monkeypatch.setattr(runlock.Lease, "stop", lambda self: None)
    run = runlock.Lock(storage.RunDir(f"{gcs_bucket}/late-{late_write}"))
    run.dir.mkdir()
    real = storage.Versions.write_if
    taker = json.dumps({"host": "elsewhere", "pid": 1, "purpose": "train.py --resume", "token": "theirs",
                        "since": "2026-11-27 12:00:00", "heartbeat": time.time()}).encode()

    def late(self, name, content, generation):
        out = real(self, name, content, generation)  # the store takes the write...
        monkeypatch.setattr(storage.Versions, "write_if", real)
        time.sleep(3 * every)  # ...but its answer arrives after a pause,
        real(self, runlock.LOCK, taker, out)  # during which another process took the run
        return out

    if late_write == "take":
        monkeypatch.setattr(storage.Versions, "write_if", late)
    with run.writer("train.py"):
        if late_write == "renewal":
            monkeypatch.setattr(storage.Versions, "write_if", late)
            run.dir.fence.__self__.renew()
        said = f"this process lost the lease on {run} (train.py --resume (pid 1 on elsewhere, since 2026-11-27"
        with pytest.raises(RunError, match=re.escape(said)):
            run.dir.check_fence()
    assert run.dir.read_bytes(runlock.LOCK) == taker  # the taker's lock stays


def test_a_holder_paused_inside_its_save_never_commits_it(journey, gcs_refusals):
    """The holder of a run in the bucket is paused (SIGSTOP) while its asynchronous save of checkpoint 8
    is in flight (the store busy with its arrays), past its lease; `--resume` takes the run over from
    checkpoint 4 and trains to step 6. When the first continues (SIGCONT) its save goes on, but the
    commit marker is behind the lease's fence: checkpoint 8 is never committed, and the first stops
    with its one line (it used to commit the step the new holder had resumed before)."""
    bucket, _, _, cwd = journey
    run = f"{bucket}/paused-save"
    ttl = 6
    env = {**os.environ, runlock.LEASE_TTL_ENV: str(ttl)}
    command = [sys.executable, str(REPO / "train.py")]
    args = tiny(run, f"{bucket}/data", "training.steps=24", "checkpoint.every=4", "training.eval_every=4")
    gcs_refusals(f"{run}/checkpoints/8/default/", status=503)  # its arrays: retried while the store is busy
    first = subprocess.Popen([*command, *args], cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 180
        while gcs_refusals.refused() == 0 and first.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert first.poll() is None and checkpoints(run) == [4], first.communicate()[1][-2000:]
        first.send_signal(signal.SIGSTOP)  # inside the save of checkpoint 8
        time.sleep(ttl + 1)
        second = subprocess.run([*command, "--resume", f"run_dir={run}", "training.steps=6"], cwd=cwd, env=env,
                                capture_output=True, text=True, timeout=300)
        assert second.returncode == 0, second.stdout + second.stderr
        assert "resuming from step 4" in second.stdout
        gcs_refusals.lift()
        first.send_signal(signal.SIGCONT)
        _, err = first.communicate(timeout=180)
    finally:
        first.kill()
    assert first.returncode == 2, err
    assert err.strip().splitlines()[-1].startswith(f"error: this process lost the lease on {run} ("), err[-2000:]
    assert checkpoints(run) == [4, 6]  # nothing of the first's checkpoint 8 counts as saved


def test_a_store_that_cannot_be_reached_is_one_line_within_seconds(tmp_path):
    """No server where the store should be (a closed port: as no network, or a wrong address): plot.py and
    data.py --verify say so in one line, at once, where the client retried each request with backoff for
    half a minute and printed its tracebacks first."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}", "GOOGLE_AUTH_TOKEN_FOR_TESTING": "x"}
    for argv in (["plot.py", "gs://nobucket/run"], ["data.py", "--verify", "gs://nobucket/d"]):
        started = time.monotonic()
        done = subprocess.run([sys.executable, *argv], cwd=pathlib.Path(__file__).parent, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and time.monotonic() - started < 30, (argv, done.stderr[-2000:])
        assert done.stderr.strip().splitlines() == [
            f"error: {argv[-1]}: cannot reach the store at 127.0.0.1:{port} (Connection refused); check the "
            f"network, or where STORAGE_EMULATOR_HOST points"], argv
