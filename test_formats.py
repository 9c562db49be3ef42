"""Runs written by earlier versions stay readable: the fixture runs under fixtures/runs/ (each made by the
train.py of an earlier commit, fixtures/make_run.py, with the commit in its made.json) resume exactly,
evaluate, sample, export and start fine-tuning under today's code; a format newer than the code is
refused in one line naming the version to upgrade to; a checkpoint whose format says it carries
fingerprints and does not is still refused (formats.py).

Each fixture is a run killed just after its step-4 checkpoint of an 8-step job; reference.jsonl holds
the losses of steps 5-8 that the uninterrupted run logged under the code that made it."""
from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest
import torch
import transformers

import convert_torch
import eval as eval_lib
import sample
import train
from core import errors
from store import fingerprints, formats, rundir
from tokendata import loader, shards

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "runs"
MADE = sorted(p.name for p in FIXTURES.iterdir() if (p / "made.json").is_file())
FORMAT_1 = {"2026-11-22", "2026-11-23"}  # written before checkpoints carried fingerprints


def test_every_fixture_is_here():
    """One fixture per format written so far (two of format 1: the model changed on 2026-11-23), each as
    make_run.py made it."""
    assert MADE == ["2026-11-22", "2026-11-23", "2026-11-24", "2026-11-26"]
    for name in MADE:
        made = json.loads((FIXTURES / name / "made.json").read_text())
        assert made["commit_date"].startswith(name) and len(made["commit"]) == 40
        assert not (FIXTURES / name / "run" / formats.FILE).exists()  # all from before format 3


@pytest.fixture
def old_run(request, tmp_path):
    """A copy of the fixture `request.param`: (its run directory, its data directory, its reference rows)."""
    shutil.copytree(FIXTURES / request.param, tmp_path / request.param)
    root = tmp_path / request.param
    reference = [json.loads(line) for line in (root / "reference.jsonl").read_text().splitlines()]
    return root / "run", root / "data", reference


def rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("old_run", MADE, indirect=True)
def test_an_old_run_resumes_with_the_losses_it_would_have_had(old_run, capsys):
    """--resume continues the run from its step-4 checkpoint with the losses, tokens and learning rates its
    own version logged when it never stopped; a format 1 checkpoint says, in one line, that it cannot be
    verified. The run is in today's format afterwards: its new checkpoint carries fingerprints."""
    run, data, reference = old_run
    assert train.main(["--resume", f"run_dir={run}", f"data.dir={data}"]) == 0
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "written before checkpoints carried fingerprints" in line]
    assert len(said) == (1 if run.parent.name in FORMAT_1 else 0), out
    got = rows(run)[4:]
    assert [r["step"] for r in got] == [r["step"] for r in reference] == [5, 6, 7, 8]
    for key in ("loss", "lr", "grad_norm"):  # the same numbers up to the last bits of another CPU
        np.testing.assert_allclose([r[key] for r in got], [r[key] for r in reference], rtol=1e-5, err_msg=key)
    assert [r["tokens"] for r in got] == [r["tokens"] for r in reference]
    assert json.loads((run / formats.FILE).read_text()) == {**formats.record(), "checkpoints_after": 4}  # resumed at 4
    with rundir.Run(run).checkpoints.read() as saved:
        assert fingerprints.checkpoint_format(saved.custom_metadata(8)) == formats.FORMAT
        assert saved.tokens(8) == reference[-1]["tokens"]


def nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[target], written out in numpy (float64)."""
    logits = logits.astype(np.float64)
    top = logits.max(-1, keepdims=True)
    logz = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    return logz - np.take_along_axis(logits, targets[..., None], -1)[..., 0]


@pytest.mark.parametrize("old_run", MADE, indirect=True)
def test_an_old_run_evaluates_samples_exports_and_starts_a_fine_tuning(old_run, tmp_path, capsys):
    """eval.py, sample.py, convert_torch.py and training.init_from read an old run's checkpoint: its
    weights give, on the batch of step 5, the training loss its own version logged there; the exported
    transformers model gives the same logits; eval.py's loss on the validation split is the one those
    logits give; and a fine-tuning run starts from its weights."""
    run, data, reference = old_run
    model, step = rundir.Run(run).weights.load_model()
    assert step == 4
    batch = np.asarray(next(loader.open_loader(shards.open_data(data), "train", 32, 8).iterate(4, prefetch=0)))  # (8, 33): step 5's
    logits = np.asarray(model(batch[:, :-1]))[..., :384]
    np.testing.assert_allclose(nll(logits, batch[:, 1:]).mean(), reference[0]["loss"], rtol=1e-5)

    export = tmp_path / "hf"
    assert convert_torch.main(["--checkpoint", str(run), "--format", "hf", "--out", str(export)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    with torch.no_grad():
        theirs = hf(torch.from_numpy(batch[:, :-1]).long()).logits.numpy()
    np.testing.assert_allclose(theirs, logits, rtol=1e-4, atol=1e-4)

    assert eval_lib.main(["--checkpoint", str(run), "--data", str(data), "--lengths", "32"]) == 0
    [row] = json.loads((run / "eval" / "step4.json").read_text())["perplexity"]["rows"]
    val = np.fromfile(data / "val_00000.bin", np.uint16).astype(np.int32)
    windows = np.stack([val[i * 32:i * 32 + 33] for i in range((len(val) - 1) // 32)])  # the whole split, once
    expected = nll(np.asarray(model(windows[:, :-1]))[..., :384], windows[:, 1:]).mean()
    np.testing.assert_allclose(row["loss"], expected, rtol=1e-5)

    assert sample.main(["--checkpoint", str(run), "--prompt", "the model", "--max-new-tokens", "8",
                        "--temperature", "0"]) == 0
    assert "the model" in capsys.readouterr().out

    tuned = tmp_path / "tuned"
    assert train.main([f"run_dir={tuned}", f"data.dir={data}", f"training.init_from={run}", "training.steps=1",
                       "training.batch_size=8", "training.seq_len=32", "training.warmup_steps=0",
                       "training.eval_windows=8", "checkpoint.every=1"]) == 0
    assert json.loads((tuned / formats.FILE).read_text())["format"] == formats.FORMAT


@pytest.mark.parametrize("old_run", ["2026-11-24"], indirect=True)
@pytest.mark.parametrize("history", ["count altered", "batch changed at step 2"])
def test_a_format_2_checkpoints_tokens_must_be_what_the_record_fixes(old_run, history, capsys):
    """Format 2 has no fingerprint of a checkpoint's metadata: its tokens trained (1024 at step 4, 8 x 32 a
    step) edited to a plausible 1280 would give a resumed run 25% too many tokens. Where the config and every
    row of the log fix the tokens of a step (the batch and context never changed), the count must be step x
    them, or the checkpoint is damaged, refused in one line, nothing moved; where the log shows a resume
    that changed the batch, the count the checkpoint records is the run's, and is taken."""
    run, data, _ = old_run
    meta = run / "checkpoints" / "4" / "_CHECKPOINT_METADATA"
    text = json.loads(meta.read_text())
    if history == "count altered":
        text["custom_metadata"]["tokens"] = 1280
    else:  # steps 1-2 of 4 x 32 tokens, then 8 x 32: 2 * 128 + 2 * 256
        logged = rows(run)
        for row in logged:
            row["tokens"] = 128 * min(row["step"], 2) + 256 * max(row["step"] - 2, 0)
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in logged))
        text["custom_metadata"]["tokens"] = 768
    meta.write_text(json.dumps(text))
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    if history == "count altered":
        assert train.cli(["--resume", f"run_dir={run}", f"data.dir={data}"]) == 2
        assert capsys.readouterr().err == (
            f"error: checkpoint 4 in {run / 'checkpoints'} cannot be restored: its tokens trained (1280 in "
            f"_CHECKPOINT_METADATA) are not the 4 x 256 = 1024 that the run's config and log fix (a format 2 "
            f"checkpoint has no fingerprint of its metadata): the file was altered or damaged\n")
        assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before
        return
    assert train.main(["--resume", f"run_dir={run}", f"data.dir={data}"]) == 0
    assert [r["tokens"] for r in rows(run)[4:]] == [768 + 256 * (s - 4) for s in (5, 6, 7, 8)]


def newer(record: dict) -> dict:
    return {**record, "format": formats.FORMAT + 1, "since": "2027-01-05"}


@pytest.mark.parametrize("old_run", ["2026-11-26"], indirect=True)
def test_a_format_newer_than_the_code_is_refused_naming_the_version(old_run, capsys):
    """A run directory, or a checkpoint, written by a newer version (a downgrade under a run): every tool
    says so in one line naming the version that reads it, and nothing is moved or rewritten."""
    run, data, _ = old_run
    (run / formats.FILE).write_text(json.dumps(newer(formats.record())))
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    for cli, argv in [(train.cli, ["--resume", f"run_dir={run}", f"data.dir={data}"]),
                      (eval_lib.cli, ["--checkpoint", str(run)]),
                      (sample.cli, ["--checkpoint", str(run), "--prompt", "a"]),
                      (convert_torch.cli, ["--checkpoint", str(run), "--out", str(run.parent / "x")])]:
        assert cli(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: run directory {run} is in format {formats.FORMAT + 1}, written by the "
                              f"toolkit's versions from 2027-01-05 on") and "version of 2027-01-05 or later" in err
        assert "\n" not in err
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before
    (run / formats.FILE).unlink()
    before.remove(formats.FILE)
    meta = run / "checkpoints" / "4" / "_CHECKPOINT_METADATA"
    text = json.loads(meta.read_text())
    text["custom_metadata"] = newer(text["custom_metadata"])
    meta.write_text(json.dumps(text))
    assert train.cli(["--resume", f"run_dir={run}", f"data.dir={data}"]) == 2
    assert f"checkpoint 4 in {run / 'checkpoints'} is in format {formats.FORMAT + 1}" in capsys.readouterr().err
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before  # not moved aside: it is not damaged


def test_a_newer_format_dated_before_the_codes_own_is_said_to_be_altered():
    """Format 99 recorded with a first date no later than this code's own format's: no version wrote it, so
    the line says the record was altered (it named "the toolkit's versions from 2026-11-27 on" to upgrade to)."""
    said = formats.too_new("checkpoint 4 in X", {"format": 99, "since": formats.SINCE[formats.FORMAT]})
    assert said == (f"checkpoint 4 in X says it is in format 99, first written on {formats.SINCE[formats.FORMAT]}, "
                    f"but no version wrote a format after {formats.FORMAT} by then (format {formats.FORMAT} is from "
                    f"{formats.SINCE[formats.FORMAT]}): its record was altered or damaged")
    assert "upgrade" in formats.too_new("X", {"format": 99, "since": "2099-01-01"})


@pytest.mark.parametrize("damage", ["fingerprints gone", "format gone", "tokens", "format 1", "metadata file gone",
                                    "metadata file cut"])
def test_a_fingerprinted_checkpoint_without_its_fingerprints_is_refused(tmp_path, damage):
    """The fail-closed check stays: a checkpoint of format 3 whose fingerprints are missing, whose metadata
    lost its format (it would pass for format 2), whose tokens trained were altered, or which claims
    format 1 while carrying fingerprints is refused as corrupt, never read as an unverifiable old one."""
    run = tmp_path / "run"
    run.mkdir()
    state = {"params": {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, "step": np.asarray(8, np.int32)}
    with rundir.Run(run).checkpoints.write() as saver:
        saver.save(8, state, tokens=1024)
    with rundir.Run(run).checkpoints.read() as saved:  # as saved, it reads
        np.testing.assert_array_equal(saved.load(8)[0]["params"]["w"], state["params"]["w"])
        assert saved.tokens(8) == 1024
    meta = run / "checkpoints" / "8" / "_CHECKPOINT_METADATA"
    text = json.loads(meta.read_text())
    custom = text["custom_metadata"]
    if damage.startswith("metadata file"):  # a file lost or cut off is damage, never an unverified format 1
        meta.unlink() if damage.endswith("gone") else meta.write_text(meta.read_text()[:40])
        with pytest.raises(rundir.RunError, match=r"^checkpoint 8 in .* cannot be read: its metadata "
                                                  r"\(_CHECKPOINT_METADATA\) is missing or unreadable"):
            rundir.Run(run).weights.load_params(8)
        return
    if damage == "fingerprints gone":
        del custom["fingerprints"]
    elif damage == "format gone":
        del custom["format"]
    elif damage == "tokens":
        custom["tokens"] = 99999
    else:
        custom["format"] = 1
    meta.write_text(json.dumps(text))
    with pytest.raises(rundir.RunError, match=r"^checkpoint 8 in .* is corrupt: its (array fingerprints|metadata|format)"):
        rundir.Run(run).weights.load_params(8)


@pytest.mark.parametrize("evidence", ["a checkpoint before it", "format.json", "none"])
def test_an_emptied_metadata_is_not_read_as_format_1(tmp_path, evidence, capsys):
    """A checkpoint whose custom metadata was emptied looks like a format 1 one, which has none. It is refused
    as corrupt when the run shows it was not written so: a checkpoint before it carries fingerprints, or
    RUN/format.json says every checkpoint after an earlier step records its format. With neither (a lone
    checkpoint in a run without format.json) it is read as format 1 is, unverified, with the line saying so."""
    run = tmp_path / "run"
    run.mkdir()
    state = {"params": {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, "step": np.asarray(8, np.int32)}
    with rundir.Run(run).checkpoints.write() as saver:
        if evidence == "a checkpoint before it":
            saver.save(4, {**state, "step": np.asarray(4, np.int32)}, tokens=512)
        saver.save(8, state, tokens=1024)
    if evidence == "format.json":
        (run / formats.FILE).write_text(json.dumps(formats.run_record(0, None)))
    meta = run / "checkpoints" / "8" / "_CHECKPOINT_METADATA"
    text = json.loads(meta.read_text())
    text["custom_metadata"] = {}
    meta.write_text(json.dumps(text))
    if evidence == "none":
        np.testing.assert_array_equal(rundir.Run(run).weights.load_params(8)[0]["w"], state["params"]["w"])
        assert "was written before checkpoints carried fingerprints (format 1" in capsys.readouterr().err
        return
    why = "checkpoint 4 before it carries fingerprints" if evidence != "format.json" else \
        "the run's format.json says every checkpoint after step 0 records its format"
    with pytest.raises(rundir.RunError, match=r"^checkpoint 8 in .* is corrupt: its metadata \(_CHECKPOINT_METADATA\) "
                                              r"holds nothing of this project's, .*" + why):
        rundir.Run(run).weights.load_params(8)
    if evidence == "a checkpoint before it":  # the one before still reads
        assert rundir.Run(run).weights.load_params(4)[0]["w"].shape == (2, 3)


def test_format_json_keeps_the_first_step_its_checkpoints_record_their_format_after():
    assert formats.run_record(0, None) == {**formats.record(), "checkpoints_after": 0}
    assert formats.run_record(300, None)["checkpoints_after"] == 300  # an older run resumed at 300
    assert formats.run_record(900, formats.run_record(300, None))["checkpoints_after"] == 300
    assert formats.run_record(900, formats.record())["checkpoints_after"] == 900  # a record without the step
    assert formats.checkpoints_after({"checkpoints_after": -1}) is None
    assert formats.checkpoints_after({"checkpoints_after": True}) is None


@pytest.mark.parametrize("what", ["a directory", "a link to /dev/zero"])
def test_a_format_json_that_is_no_file_is_damage(tmp_path, what, capsys):
    """RUN/format.json that is a directory, or a link to a device: one line naming it as damaged (it was read as
    absent, so the run passed for one from before format 3), from every reader."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model: test\n")
    if what == "a directory":
        (run / formats.FILE).mkdir()
    else:
        (run / formats.FILE).symlink_to("/dev/zero")
    with pytest.raises(errors.RunError) as e:
        rundir.Run(run).record.check_format()
    assert str(e.value) == (f"{run / formats.FILE} is there but is not a file: it is damaged; remove it (or put the "
                            f"file back) to read the run")
    assert sample.cli(["--checkpoint", str(run), "--prompt", "a"]) == 2
    assert "is there but is not a file: it is damaged" in capsys.readouterr().err
