"""Remote data and run directories, against fsspec's in-memory filesystem as the object store.

memory://bucket-... stands in for gs://bucket: the same fsspec calls reach it. orbax cannot write a
checkpoint to memory:// (tensorstore has its own drivers), so the remote run test keeps the
checkpoints on the local disk and everything else train.py writes in the stand-in store.
"""
import json
import os
import random
import shutil
import time
import uuid

import fsspec
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import safetensors.numpy
from fsspec.implementations.memory import MemoryFileSystem

import convert_torch
import data
import train
from core import json_log, storage
from store import checkpoints, rundir, runlock
from test_train import WORDS, deterministic, tiny
from tokendata import finetune_data, loader, permutation, shards


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A tiny corpus prepared into several small shards."""
    root = tmp_path_factory.mktemp("remote")
    src = root / "src"
    src.mkdir()
    for i in range(30):
        rng = random.Random(i)
        (src / f"doc{i:02d}.txt").write_text(
            "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 12))) for _ in range(40)) + "\n")
    index = data.prepare([str(src)], root / "data", vocab_size=300, val_fraction=0.3, shard_tokens=1500,
                         progress=False)
    assert len(index["splits"]["train"]["shards"]) >= 4 and index["splits"]["val"]["tokens"] > 1000
    return root / "data"


@pytest.fixture
def bucket():
    """A fresh memory:// location."""
    url = f"memory://bucket-{uuid.uuid4().hex[:8]}"
    yield url
    fs, root = fsspec.core.url_to_fs(url)
    if fs.exists(root):
        fs.rm(root, recursive=True)


def upload(local_dir, url):
    fs, root = fsspec.core.url_to_fs(url)
    for f in sorted(local_dir.iterdir()):
        fs.pipe_file(f"{root}/{f.name}", f.read_bytes())


def shard_names(prepared) -> list[str]:
    """Every shard, in the order index.json lists them."""
    index = json.loads((prepared / "index.json").read_text())
    return [s["file"] for split in index["splits"].values() for s in split["shards"]]


def record_reads(monkeypatch) -> list[tuple]:
    """Every read of the stand-in store: ("file", path) for a whole file, ("ranges", [(path, start, end)])
    for one request of byte ranges."""
    reads, cat_file, cat_ranges, inside = [], MemoryFileSystem.cat_file, MemoryFileSystem.cat_ranges, []

    def whole(self, path, *args, **kwargs):
        if not inside:  # (fsspec's cat_ranges of a filesystem without its own reads each range with cat_file)
            reads.append(("file", path.rsplit("/", 1)[-1]))
        return cat_file(self, path, *args, **kwargs)

    def ranges(self, paths, starts, ends, *args, **kwargs):
        reads.append(("ranges", [(p.rsplit("/", 1)[-1], a, b) for p, a, b in zip(paths, starts, ends)]))
        inside.append(1)
        try:
            return cat_ranges(self, paths, starts, ends, *args, **kwargs)
        finally:
            inside.pop()

    monkeypatch.setattr(MemoryFileSystem, "cat_file", whole)
    monkeypatch.setattr(MemoryFileSystem, "cat_ranges", ranges)
    return reads


def test_remote_data_is_read_by_ranges_like_the_local_directory(prepared, bucket, tmp_path, monkeypatch):
    """At start only index.json and the tokenizer are read (and one listing checks every shard's size);
    each batch is one request of byte ranges, exactly the bytes of this process's rows; the batches
    equal those of the memory-mapped local directory; nothing is written to the local disk."""
    url = f"{bucket}/corpus"
    upload(prepared, url)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # where a cache would go
    reads = record_reads(monkeypatch)
    remote = loader.TextLoader(shards.open_data(url), "train", 16, 4, seed=3, process_index=1, process_count=2)
    assert sorted(name for kind, name in reads) == ["index.json", "tokenizer.json"]
    local = loader.TextLoader(shards.open_data(prepared), "train", 16, 4, seed=3, process_index=1, process_count=2)
    itemsize = np.dtype(remote.index["dtype"]).itemsize
    for step in (0, 1, 7):
        reads.clear()
        np.testing.assert_array_equal(remote.get_batch(step), local.get_batch(step))
        assert [kind for kind, _ in reads] == ["ranges"]  # one request
        assert sum(b - a for _, a, b in reads[0][1]) == 2 * 17 * itemsize  # this process's 2 rows of 17 tokens
    reads.clear()
    batches = remote.iterate(5)
    for step in (5, 6):
        np.testing.assert_array_equal(next(batches), local.get_batch(step))
    batches.close()
    text = "the cat sat"
    assert shards.open_data(url).tokenizer().encode(text).ids == shards.open_data(prepared).tokenizer().encode(text).ids
    assert not (tmp_path / "home").exists()
    # every evaluation window of the split, in order, as locally
    for a, b in zip(loader.eval_windows(shards.open_data(url), "val", 16, 3), loader.eval_windows(shards.open_data(prepared), "val", 16, 3)):
        np.testing.assert_array_equal(a, b)


def test_a_failed_remote_read_is_one_line_naming_the_file(prepared, bucket, monkeypatch):
    url = f"{bucket}/corpus"
    upload(prepared, url)
    remote = loader.TextLoader(shards.open_data(url), "train", 16, 1, seed=3)

    def broken(self, paths, *args, **kwargs):
        raise ConnectionResetError("connection reset by peer")

    monkeypatch.setattr(MemoryFileSystem, "cat_ranges", broken)
    # the 8 batches of one request (one row each): the shards their 17 tokens lie in
    windows = permutation.permute(np.arange(8), remote.num_windows, 3, 0)
    names = [s["file"] for s in remote.index["splits"]["train"]["shards"]]
    starts = np.cumsum([0] + [s["tokens"] for s in remote.index["splits"]["train"]["shards"]])
    shard = lambda token: names[int(np.searchsorted(starts, token, side="right")) - 1]  # noqa: E731
    read = sorted({shard(t) for w in windows.tolist() for t in (w * 16, w * 16 + 16)})
    assert len(read) > 1
    with pytest.raises(data.DataError) as err:
        next(remote.iterate(0))  # from the prefetching thread, handed over as it is
    assert str(err.value) == (f"reading {url}/{{{','.join(read)}}} failed (ConnectionResetError: "
                              f"connection reset by peer)")


def test_a_damaged_remote_shard_is_one_clear_error(prepared, bucket, tmp_path, capsys):
    """A shard of another size than index.json records is found by the listing at start: one line, no
    run directory; a flipped byte that makes an id outside the vocabulary is named when its batch is read."""
    url = f"{bucket}/corpus"
    upload(prepared, url)
    index = json.loads((prepared / "index.json").read_text())
    entry = index["splits"]["train"]["shards"][1]
    name, size = entry["file"], entry["tokens"] * 2
    fs, root = fsspec.core.url_to_fs(url)
    fs.pipe_file(f"{root}/{name}", (prepared / name).read_bytes()[:-2])
    assert train.cli(tiny(tmp_path / "run", url)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {url}/{name}: expected {size} bytes ({entry['tokens']} uint16 tokens), "
                   f"found {size - 2} bytes"]
    assert not (tmp_path / "run").exists()

    raw = bytearray((prepared / name).read_bytes())
    raw[6:8] = (65535).to_bytes(2, "little")  # token 3 of the shard: id 65535, outside the vocabulary of 300
    fs.pipe_file(f"{root}/{name}", bytes(raw))
    stream = loader.Stream(shards.open_data(url), "train")
    first = stream.starts[1]  # the damaged shard's first token in the split's stream
    with pytest.raises(data.DataError) as e:
        stream.check(stream.read_rows([first], 8), lambda: [(first, 8)])
    assert str(e.value).startswith(f"{url}/{name}: token 3 (at byte 6) is id 65535, outside the vocabulary of 300")


def test_a_run_directory_in_the_object_store(prepared, bucket, tmp_path, monkeypatch, capsys):
    """Config, data reference, tokenizer, metrics and summary land in the store; a resume and
    eval/sample/convert's readers read them back from there."""
    data_url, run_url = f"{bucket}/corpus", f"{bucket}/runs/r1"
    upload(prepared, data_url)
    ckpt = tmp_path / "ckpt"
    real_ckpt = storage.RunDir.checkpoint_dir
    monkeypatch.setattr(storage.RunDir, "checkpoint_dir",  # orbax cannot reach memory://: see the docstring
                        lambda self: ckpt if self.remote else real_ckpt(self))
    fs, root = fsspec.core.url_to_fs(run_url)
    logged_at_save, real_save = {}, checkpoints.Saver.save

    def save(self, step, state, **kwargs):  # what the store's log holds as checkpoint `step` is saved
        logged_at_save[step] = [json.loads(line)["step"] for line in fs.cat_file(f"{root}/metrics.jsonl").splitlines()]
        return real_save(self, step, state, **kwargs)

    monkeypatch.setattr(checkpoints.Saver, "save", save)
    assert train.main(tiny(run_url, data_url)) == 0
    # every checkpoint's step has its row in the store before the checkpoint exists: a resume continues the
    # log after it, and a row the upload had not carried yet would be lost for good
    assert logged_at_save == {4: [1, 2, 3, 4], 8: list(range(1, 9))}

    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)) == [
        "config.yaml", "data.json", "format.json", "loss.png", "metrics.jsonl", "summary.json", "tokenizer.json"]
    assert fs.cat_file(f"{root}/tokenizer.json") == (prepared / "tokenizer.json").read_bytes()
    assert json.loads(fs.cat_file(f"{root}/data.json"))["index"] == f"{data_url}/index.json"
    summary = json.loads(fs.cat_file(f"{root}/summary.json"))
    assert summary["steps"] == 8 and summary["checkpoint"] == str(ckpt / "8")

    def rows():
        return [json.loads(line) for line in fs.cat_file(f"{root}/metrics.jsonl").decode().splitlines()]

    straight = rows()
    assert [r["step"] for r in straight] == list(range(1, 9))

    # as if preempted after the checkpoint of step 4: the resume reads config.yaml and metrics.jsonl
    # from the store and replays steps 5..8 exactly
    shutil.rmtree(ckpt / "8")
    assert train.main(["--resume", f"run_dir={run_url}"]) == 0
    assert [deterministic(r) for r in rows()] == [deterministic(r) for r in straight]

    # data.json records each data file's version in the store; a resume on a rewritten shard (even
    # with the same bytes: the store cannot tell) is refused, naming it, and the run stays as it was
    recorded = json.loads(fs.cat_file(f"{root}/data.json"))["versions"]
    assert sorted(recorded) == sorted(["tokenizer.json", *shard_names(prepared)])
    name = shard_names(prepared)[2]
    data_fs, data_root = fsspec.core.url_to_fs(data_url)
    time.sleep(0.01)
    data_fs.pipe_file(f"{data_root}/{name}", data_fs.cat_file(f"{data_root}/{name}"))
    before = rows()
    capsys.readouterr()
    assert train.cli(["--resume", f"run_dir={run_url}", "training.steps=10"]) == 2
    assert capsys.readouterr().err == (f"error: data.dir {data_url} changed since this run started: {name} differs "
                                       f"from the versions {run_url}/data.json records; resume on the data it "
                                       f"trained on ({data_url}), or start a new run from it "
                                       f"(training.init_from={run_url})\n")
    assert rows() == before and sorted(ckpt.iterdir()) == [ckpt / "4", ckpt / "8"]

    cfg = rundir.Run(run_url).record.config()  # what eval, sample and convert read
    assert cfg.run_dir == run_url and cfg.data.dir == data_url and cfg.model.vocab_size == 300
    params, step = rundir.Run(run_url).weights.load_params()
    assert step == 8
    with ocp.CheckpointManager(ckpt) as mngr:  # orbax directly, no project code
        direct = mngr.restore(8, args=ocp.args.StandardRestore())["params"]
    assert len(jax.tree.leaves(direct)) == len(jax.tree.leaves(params))
    jax.tree.map(np.testing.assert_array_equal, sorted(jax.tree.leaves(params), key=np.size),
                 sorted(jax.tree.leaves(direct), key=np.size))

    # sample.py's tokenizer and convert_torch.py's export, from the run in the store
    local_tok = shards.open_data(prepared).tokenizer()
    assert rundir.Run(run_url).record.tokenizer().encode("the cat sat").ids == local_tok.encode("the cat sat").ids
    out = tmp_path / "export"
    assert convert_torch.main(["--checkpoint", run_url, "--out", str(out)]) == 0
    assert (out / "tokenizer.json").read_bytes() == (prepared / "tokenizer.json").read_bytes()
    exported = safetensors.numpy.load_file(str(out / "model.safetensors"))
    # every parameter, the embedding with its real rows only (300 of the 384 the model pads it to)
    padding = (384 - 300) * direct["wte"].shape[1]
    assert sum(v.size for v in exported.values()) == sum(np.size(x) for x in jax.tree.leaves(direct)) - padding


def test_an_unreachable_store_is_one_line(tmp_path, capsys):
    # no fsspec implementation is registered for this scheme
    assert train.cli(["run_dir=nosuchstore://bucket/run", "model=test"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: run_dir: nosuchstore://bucket/run: ")


def test_an_index_naming_files_outside_its_directory_is_refused(prepared, bucket, tmp_path):
    url = f"{bucket}/corpus"
    upload(prepared, url)
    fs, root = fsspec.core.url_to_fs(url)
    index = json.loads(fs.cat_file(f"{root}/index.json"))
    index["splits"]["train"]["shards"][0]["file"] = "../../outside.bin"
    fs.pipe_file(f"{root}/index.json", json.dumps(index).encode())
    with pytest.raises(data.DataError) as err:
        shards.open_data(url).index
    assert str(err.value) == (f"{url}/index.json is corrupt (ValueError: file name '../../outside.bin' "
                              f"outside the directory); re-run data.py with --overwrite")


def test_metrics_log_in_the_store_matches_the_local_one(bucket, tmp_path, monkeypatch):
    """JsonLines: the same rows, kept and appended, give the same file in the store as on disk; in the
    store they appear at flush() (or once FLUSH_SECONDS have passed), whole."""
    old = [{"step": s, "loss": 1.0 / s} for s in range(1, 6)]
    new = [{"step": s, "loss": 2.0 / s} for s in range(4, 8)]
    files = {}
    for where in (str(tmp_path / "run"), f"{bucket}/run"):
        run = storage.RunDir(where)
        run.mkdir()
        run.write_text("metrics.jsonl", "".join(json.dumps(r) + "\n" for r in old))
        log = json_log.JsonLines(run, "metrics.jsonl", keep=lambda row: row["step"] <= 3)
        for row in new:
            log.append(row)
        if run.remote:
            assert run.read_text("metrics.jsonl").count("\n") == 3  # not uploaded yet
            log.flush()
        files[where] = run.read_text("metrics.jsonl")
        log.close()
    expected = "".join(json.dumps(r) + "\n" for r in old[:3] + new)
    assert list(files.values()) == [expected, expected]

    monkeypatch.setattr(json_log, "FLUSH_SECONDS", 0.0)  # every append uploads
    run = storage.RunDir(f"{bucket}/run2")
    log = json_log.JsonLines(run, "metrics.jsonl")
    log.append({"step": 1})
    assert run.read_text("metrics.jsonl") == '{"step": 1}\n'


def test_an_index_without_shard_hashes_is_checked_by_size(prepared, bucket):
    """Directories prepared before shards carried a sha256: sizes are still checked, a short shard is refused."""
    url = f"{bucket}/corpus"
    upload(prepared, url)
    fs, root = fsspec.core.url_to_fs(url)
    index = json.loads(fs.cat_file(f"{root}/index.json"))
    for split in index["splits"].values():
        for s in split["shards"]:
            del s["sha256"]
    fs.pipe_file(f"{root}/index.json", json.dumps(index).encode())
    name = index["splits"]["val"]["shards"][0]["file"]
    size = index["splits"]["val"]["shards"][0]["tokens"] * np.dtype(index["dtype"]).itemsize
    fs.pipe_file(f"{root}/{name}", (prepared / name).read_bytes()[:-2])  # one token short
    with pytest.raises(data.DataError) as err:
        shards.open_data(url).index
    tokens = index["splits"]["val"]["shards"][0]["tokens"]
    assert str(err.value) == f"{url}/{name}: expected {size} bytes ({tokens} uint16 tokens), found {size - 2} bytes"
    fs.pipe_file(f"{root}/{name}", (prepared / name).read_bytes())
    np.testing.assert_array_equal(loader.TextLoader(shards.open_data(url), "val", 16, 2).get_batch(3),
                                  loader.TextLoader(shards.open_data(prepared), "val", 16, 2).get_batch(3))


def test_remote_prompt_completion_data_reads_its_loss_masks(bucket, tmp_path, monkeypatch):
    """A fine-tuning directory in the store: at start each train mask shard is read once (the examples'
    bounds), then each batch is two requests of byte ranges, its examples' tokens and their loss
    masks, the same spans; the batches equal those read from the local directory."""
    records = [{"in_text": " " + " ".join(random.Random(i).choices(WORDS, k=4)) + " =",
                "out_text": " " + " ".join(random.Random(-i).choices(WORDS, k=3))} for i in range(60)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    local = tmp_path / "pairs"
    index = finetune_data.prepare([str(tmp_path / "pairs.jsonl")], local, seq_len=24, vocab_size=300,
                                  val_fraction=0.2, progress=False)
    masks = [s["file"] for split in index["splits"].values() for s in split["mask_shards"]]
    assert masks and all(s.get("sha256") for split in index["splits"].values() for s in split["mask_shards"])
    url = f"{bucket}/pairs"
    upload(local, url)
    reads = record_reads(monkeypatch)
    a = loader.PromptCompletionLoader(shards.open_data(url), "train", 24, 4, seed=1)
    train_masks = [s["file"] for s in index["splits"]["train"]["mask_shards"]]
    assert sorted(name for kind, name in reads) == sorted(["index.json", "tokenizer.json", *train_masks])
    b = loader.PromptCompletionLoader(shards.open_data(local), "train", 24, 4, seed=1)
    for step in (0, 5):
        reads.clear()
        got = a.get_batch(step)
        for key, value in b.get_batch(step).items():
            np.testing.assert_array_equal(got[key], value)
        (k1, tokens), (k2, masks_read) = reads
        assert (k1, k2) == ("ranges", "ranges") and [(a, b) for _, a, b in masks_read] == [
            (a // 2, b // 2) for _, a, b in tokens]  # the same spans: 2 bytes a token, 1 a mask byte


def test_a_remote_finetuned_run_samples_only_the_completion(bucket, tmp_path, monkeypatch, capsys):
    """A run in the store that fine-tuned on prompt/completion pairs is used as it was trained: sample.py
    prints the completion alone, as greedy decoding of the model (a second code path) gives it."""
    import sample
    from inference import decoding

    records = [{"in_text": " " + " ".join(random.Random(i).choices(WORDS, k=4)) + " =",
                "out_text": " " + " ".join(random.Random(-i).choices(WORDS, k=3))} for i in range(60)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    finetune_data.prepare([str(tmp_path / "pairs.jsonl")], tmp_path / "pairs", seq_len=32, vocab_size=300,
                          val_fraction=0.2, progress=False)
    ckpt, run_url = tmp_path / "ckpt", f"{bucket}/runs/pairs"
    real_ckpt = storage.RunDir.checkpoint_dir
    monkeypatch.setattr(storage.RunDir, "checkpoint_dir",  # orbax cannot reach memory://: see the docstring
                        lambda self: ckpt if self.remote else real_ckpt(self))
    assert train.main(tiny(run_url, tmp_path / "pairs")) == 0
    run = rundir.Run(run_url)
    assert run.record.is_finetuned()

    prompt = records[0]["in_text"]
    model, _ = run.weights.load_model()
    tok = run.record.tokenizer()
    eot = tok.token_to_id(shards.EOT_TOKEN)
    out = decoding.generate(model, [tok.encode(prompt, add_special_tokens=False).ids], 5, temperature=0, eot_id=eot)
    capsys.readouterr()
    assert sample.cli(["--checkpoint", run_url, "--prompt", prompt, "--temperature", "0",
                       "--max-new-tokens", "5"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["---------- sample 1/1 ----------", tok.decode(decoding.truncate(out[0], eot))]


def test_a_run_directory_in_the_object_store_has_one_writer(bucket, monkeypatch, capsys):
    """An object store has no locks: RUN/.lock is a lease with a heartbeat. A live holder is refused;
    a holder whose heartbeat stopped (a killed process) is waited out until the lease expires; an
    expired one is taken at once; the lease is renewed while held and removed on release."""
    monkeypatch.setattr(runlock, "LEASE_RENEW", 0.2)
    monkeypatch.setattr(runlock, "LEASE_TTL", 1.5)
    monkeypatch.setattr(runlock, "LEASE_SETTLE", 0.05)
    run = rundir.Run(f"{bucket}/run")
    fs, root = fsspec.core.url_to_fs(f"{bucket}/run")
    lock = f"{root}/{runlock.LOCK}"
    with run.writer("train.py"):
        first = json.loads(fs.cat_file(lock))
        time.sleep(0.5)
        assert json.loads(fs.cat_file(lock))["heartbeat"] > first["heartbeat"]  # renewed while held
        with pytest.raises(rundir.RunError, match=r"is in use by train.py \(pid \d+ on .*\); one process"):
            with run.writer("train.py --resume"):
                pass
    assert not fs.exists(lock)  # released
    # a lease left by a killed process: its heartbeat stopped 1.0 s ago, of the 1.5 s a lease lasts
    fs.pipe_file(lock, json.dumps({"purpose": "train.py", "pid": 1, "host": "gone", "token": "x",
                                   "heartbeat": time.time() - 1.0}).encode())
    start = time.time()
    with run.writer("train.py --resume"):
        waited = time.time() - start
        assert json.loads(fs.cat_file(lock))["purpose"] == "train.py --resume"
    assert 0.4 < waited < 1.5, waited
    assert "heartbeat stopped" in capsys.readouterr().out
    fs.pipe_file(lock, json.dumps({"purpose": "train.py", "token": "y", "heartbeat": time.time() - 60}).encode())
    start = time.time()
    with run.writer("train.py --resume"):
        assert time.time() - start < 0.4  # long expired: taken at once


def test_a_killed_writers_temporary_file_is_cleared_by_the_next_write(tmp_path):
    """RUN/NAME is written as NAME.tmp-PID and renamed; what a writer killed before the rename left
    (eval.py killed while drawing its plot) is deleted by the next write of NAME, while a live
    process's is left alone."""
    run = storage.RunDir(tmp_path / "run")
    (tmp_path / "run" / "eval").mkdir(parents=True)
    dead = tmp_path / "run" / "eval" / "step8-perplexity.png.tmp-4194305"  # past any pid_max: no such process
    live = tmp_path / "run" / "eval" / f"step8-perplexity.png.tmp-{os.getppid()}"
    other = tmp_path / "run" / "eval" / "step16-perplexity.png.tmp-4194305"  # another file's: not this write's
    for leftover in (dead, live, other):
        leftover.write_bytes(b"half a png")
    run.write_bytes("eval/step8-perplexity.png", b"the plot")
    assert (tmp_path / "run" / "eval" / "step8-perplexity.png").read_bytes() == b"the plot"
    assert not dead.exists() and live.exists() and other.exists()
