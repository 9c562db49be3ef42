"""Hand a trained model to PyTorch and Hugging Face, and bring transformers checkpoints into a run.

    python convert_torch.py --checkpoint RUN_DIR [--step N] --out DIR [--format torch|hf|peft] [--overwrite]
    python convert_torch.py --import-hf HF_DIR --out RUN_DIR [--overwrite]

Export writes `model.safetensors`, `config.json` and the run's `tokenizer.json` (no pickles).
`--format torch` (the default) is read by the `GPT` module of torch_gpt.py:

    from torch_gpt import GPT               # interop/torch_gpt.py, copied beside or on sys.path
    model = GPT.from_pretrained(DIR)          # torch and safetensors only; no JAX needed

`--format hf` writes the transformers layout of the model's family, for
`AutoModelForCausalLM.from_pretrained(DIR)`:

    ALiBi, LayerNorm after the embedding           BLOOM      (BloomForCausalLM)
    learned positions                              GPT-2      (GPT2LMHeadModel)
    learned positions read at offset 2             OPT        (OPTForCausalLM)
    rotary, interleaved pairs, parallel block      GPT-J      (GPTJForCausalLM)
    rotary, half-split, LayerNorm                  GPT-NeoX   (GPTNeoXForCausalLM; Pythia)
    rotary, half-split, RMSNorm, SwiGLU            LLaMA      (LlamaForCausalLM; grouped-query attention)

A LoRA run (training.lora) exports as its merged model in either format, or with `--format peft` as its
adapters alone: `adapter_config.json` and `adapter_model.safetensors` in PEFT's names, for the base in its
transformers layout (the base run exported with `--format hf`, or the transformers model it was imported
from):

    base = AutoModelForCausalLM.from_pretrained(BASE)
    model = peft.PeftModel.from_pretrained(base, DIR)

A model its family's layout cannot express exactly is refused with the reasons, never exported
approximately. Biases a layout always has are written as zeros when the model has none, which is exact.
Exports carry the real vocabulary: `vocab_size` is the tokenizer's and the embedding has that many
rows. model.py pads its embedding to a multiple of 128 and gives the padding rows the logit
PADDED_LOGIT, so a softmax over the real rows alone is the same distribution.

Import (`--import-hf`) turns a transformers directory (local, or at a gs:// URL: copied to a
temporary directory first) of any of those six families into a run directory whose step-0
checkpoint holds the parameters (the embedding padded with zero rows), reading the architecture
from config.json as transformers reads it and refusing, with the reasons, what model.py cannot
express (post-LayerNorm OPT, scaled rotary embeddings, ...). A field of config.json that is not
what it must be (hf_configs.HF_FIELDS), or a tokenizer that does not load, is one error line
naming it, before anything is written. `training.init_from=RUN_DIR` starts a
fine-tuning run from it. Every config.json we write also carries the JAX model's config under
`gpt_jax`, so JAX -> PyTorch (either format) -> JAX returns the identical config and parameters
(the embedding's padding rows, which no logit depends on, as zeros).

Every tensor is mapped exactly once in both directions (hf_layouts.py: the layouts; hf_configs.py:
config.json both ways); missing, unexpected and mis-shaped keys are listed in the error. The PyTorch module,
torch_gpt.py, reproduces model.py and follows the same switches; it imports nothing of the project,
so a copy of that file alone next to an export is all that `GPT.from_pretrained` needs (with torch,
numpy and safetensors installed). `from convert_torch import GPT`
gives the same class.

Every output (an export, an adapter, an imported run) is built beside --out and swapped into place
whole (outputs.StagedDir). A Ctrl-C (or SIGTERM, SIGHUP) before the swap stops the command with one
line, nothing written and an --out that was there as it was; one after it lets the command finish, say
what it wrote, and then that the stop came after (exit status 128 + N either way; outputs.Stops).

Exporting needs numpy and safetensors only; the GPT module and reading pytorch_model.bin need torch.
"""
from __future__ import annotations

from core import errors  # light: nothing but the standard library

if __name__ == "__main__":
    errors.stop_at_once_while_loading()  # a Ctrl-C while JAX, torch and the rest load: one line, no traceback

DESCRIPTION = __doc__.split("\n\n")[0]


def parse_args(argv):
    parser = errors.ArgumentParser(
        error=errors.ConvertError, description=DESCRIPTION, allow_abbrev=False,
        hint="usage: python convert_torch.py --checkpoint RUN_DIR --out DIR [--step N] [--format torch|hf|peft] | "
             "--import-hf HF_DIR --out RUN_DIR")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="RUN_DIR", help="export this run directory's checkpoint")
    src.add_argument("--import-hf", metavar="HF_DIR", help="import a transformers directory (GPT-2, BLOOM, GPT-J, "
                     "GPT-NeoX, OPT or LLaMA) into a run directory")
    parser.add_argument("--step", type=int, help="the checkpoint step to export (default: the last)")
    parser.add_argument("--base", metavar="BASE_DIR", help="a LoRA run's base model (a run directory) where it is now, if it moved since the run trained (default: where the run's lora_base.json records it)")
    parser.add_argument("--out", required=True, help="the directory to write (an export, or a run for --import-hf)")
    parser.add_argument("--format", default="torch", choices=("torch", "hf", "peft"),
                        help="torch: torch_gpt.py's GPT module; hf: the transformers layout of the model's family; "
                             "peft: a LoRA run's adapters as a PEFT adapter for its base in that layout "
                             "(default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    return parser.parse_args(argv)


if __name__ == "__main__":
    errors.parse_before_loading(parse_args)  # --help and argument mistakes: at once, before JAX and torch load

import contextlib
import dataclasses
import fnmatch
import json
import os
import pathlib
import shlex
import shutil
import sys
import tempfile

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from core import outputs, storage
from core.errors import ConvertError, DataError
from interop.hf_configs import config_from_hf, hf_config
from interop.hf_layouts import embedding_key, from_torch_tensors, head_key, hf_format, lora_tensors, to_torch_tensors
from interop.torch_gpt import (  # GPT: `from convert_torch import GPT` as before torch_gpt.py
    CONFIG_NAME,
    GPT,
    WEIGHTS_NAME,
)
from model import GPTConfig
from store import record, rundir
from tokendata import shards
from training import config as config_lib

__all__ = ["ConvertError", "export", "export_adapter", "import_hf", "read_run", "fetch_hf_dir", "read_hf_tensors", "read_hf_tokenizer",
           "main", "cli", "GPT", "WEIGHTS_NAME", "CONFIG_NAME", "TOKENIZER_NAME"]

TOKENIZER_NAME = "tokenizer.json"
# the settings the import's printed commands fine-tune with: peak learning rates for a pretrained model, in full
# and for LoRA's adapters (conf/config.yaml's 3e-3 and 600 steps train its small model from scratch)
FINE_TUNING = "training.steps=500 training.lr=1e-4 training.min_lr=1e-5 training.warmup_steps=50"
LORA_TUNING = "training.steps=500 training.lr=1e-3 training.min_lr=1e-4 training.warmup_steps=50"
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"  # PEFT's file names
HF_TOKENIZER_CONFIG = "tokenizer_config.json"  # what AutoTokenizer reads beside tokenizer.json


# ----------------------------------------------------------------------------------------------
# Transformers directories: weights and tokenizer


def read_hf_tensors(directory: pathlib.Path) -> dict[str, np.ndarray]:
    """The tensors of a transformers checkpoint: model.safetensors (or its shards); pytorch_model.bin
    only through torch.load(weights_only=True), which refuses anything but tensors."""
    files = sorted(directory.glob("model*.safetensors"))
    if files:
        tensors = {}
        for f in files:
            try:
                tensors.update(load_file(str(f)))
            except (SafetensorError, OSError) as e:
                raise ConvertError(f"cannot read {f} as safetensors ({e}); copy or save it again") from None
        return tensors
    binary = directory / "pytorch_model.bin"
    if not binary.is_file():
        raise ConvertError(f"no model.safetensors (or pytorch_model.bin) in {directory}")
    try:
        import torch  # the one use of torch here: exports and safetensors imports need none
    except ImportError:
        raise ConvertError(f"reading {binary} needs PyTorch (pip install torch), or convert it to model.safetensors"
                           ) from None
    try:
        state = torch.load(binary, map_location="cpu", weights_only=True)
    except Exception as e:  # a refused pickle, a damaged archive, a cut-short file: each its own exception type
        raise ConvertError(f"{binary} cannot be read by torch.load(weights_only=True), which loads tensors and "
                           f"never code ({_torch_load_reason(e)}): a damaged file, or more than tensors in it; save "
                           f"it as model.safetensors where it was made (save_pretrained does)") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConvertError(f"{binary} holds no plain state dict of tensors; save it as model.safetensors")
    return {k: v.float().numpy() for k, v in state.items()}


def _torch_load_reason(e: Exception) -> str:
    """The informative part of torch.load's error: the refused global or opcode, else its first sentence."""
    text = str(e)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(e).__name__)
    return first.split(". ")[0][:200]


def read_chat_template(hf_dir: pathlib.Path) -> str | None:
    """The chat template a transformers directory carries: its chat_template.jinja, else tokenizer_config.json's
    `chat_template` (a string, or a list of named templates: the one named "default"), else None."""
    from core import chat

    if (hf_dir / chat.CHAT_TEMPLATE).is_file():
        return (hf_dir / chat.CHAT_TEMPLATE).read_text(encoding="utf-8")
    path = hf_dir / "tokenizer_config.json"
    try:
        template = json.loads(path.read_text(encoding="utf-8")).get("chat_template") if path.is_file() else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise ConvertError(f"{path} is not readable JSON ({storage.one_line(e)}); fix it or remove it") from None
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template.strip() else None


def read_hf_tokenizer(hf_dir: pathlib.Path):
    """The tokenizer of a transformers directory, checked to load: the path of its tokenizer.json (copied as it
    is), else a byte-level BPE tokenizers.Tokenizer built from vocab.json and merges.txt, else None."""
    if (hf_dir / TOKENIZER_NAME).is_file():
        try:
            shards.load_tokenizer_file(hf_dir / TOKENIZER_NAME)
        except DataError as e:
            raise ConvertError(f"{e}; the tokenizers library cannot read it: fix it, or remove it and import "
                               f"without a tokenizer") from None
        return hf_dir / TOKENIZER_NAME
    vocab, merges = hf_dir / "vocab.json", hf_dir / "merges.txt"
    if not (vocab.is_file() and merges.is_file()):
        return None
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    try:
        tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    except Exception as e:  # the library raises a bare Exception for unreadable files
        reason = storage.one_line(e)
        raise ConvertError(f"cannot build a tokenizer from {vocab} and {merges}: {reason}") from None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([t for t in shards.EOT_CANDIDATES[:1] if t in tok.get_vocab()])
    return tok


# what a --format torch export's config.json says of its loader, for whoever opens it after transformers,
# which reads no such export, stopped on it ("Should have a `model_type` key in its config.json")
TORCH_LOAD = ("torch_gpt.GPT.from_pretrained(DIR) (interop/torch_gpt.py, copied beside it); transformers loads "
              "--format hf exports: python convert_torch.py --checkpoint RUN_DIR --format hf --out DIR")

# ----------------------------------------------------------------------------------------------
# Run directories


def read_run(run_dir, step: int | None = None, base=None):
    """(Config, params pure dict of numpy arrays, step) of a run directory's checkpoint (the last by default);
    `base`: where a LoRA run's base is now, if it moved."""
    run = rundir.existing(run_dir, base)
    cfg = run.record.config()
    params, step = run.weights.load_params(step)
    return cfg, params, step


def _eot(tokenizer_path: pathlib.Path) -> tuple[int | None, str | None]:
    """(id, text) of a tokenizer.json's end-of-text token, (None, None) without one."""
    if not tokenizer_path.is_file():
        return None, None
    tok = shards.load_tokenizer_file(tokenizer_path)
    eot_id = shards.eot_id_of(tok)
    return (None, None) if eot_id is None else (eot_id, tok.id_to_token(eot_id))


def _is_export(directory: pathlib.Path) -> bool:
    """Whether a directory holds an export of this file: a config.json carrying `gpt_jax`."""
    try:
        meta = json.loads((directory / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and "gpt_jax" in meta


def _is_adapter(directory: pathlib.Path) -> bool:
    """Whether a directory holds a PEFT LoRA adapter (an adapter_config.json of peft_type LORA)."""
    try:
        meta = json.loads((directory / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("peft_type") == "LORA"


def _imported(entry: pathlib.Path) -> bool:
    """Whether an entry of a run directory is one an import writes: nothing a training of it added (its
    metrics, its checkpoints after step 0)."""
    from core.chat import CHAT_TEMPLATE
    from store.checkpoints import CHECKPOINTS
    from store.formats import FILE
    from store.runlock import LOCK

    if entry.name == CHECKPOINTS and entry.is_dir():
        return all(step.name == "0" for step in entry.iterdir())
    return entry.is_file() and entry.name in (record.CONFIG, FILE, TOKENIZER_NAME, CHAT_TEMPLATE, LOCK)


_OURS = {  # what --overwrite may replace, besides an empty directory, and the entries such an output has
    "export": (_is_export, f"an export of convert_torch.py (a {CONFIG_NAME} with gpt_jax)",
               lambda e: e.is_file() and e.name in (CONFIG_NAME, WEIGHTS_NAME, TOKENIZER_NAME, HF_TOKENIZER_CONFIG)),
    "adapter": (_is_adapter, f"a LoRA adapter (an {ADAPTER_CONFIG} of peft_type LORA)",
                lambda e: e.is_file() and e.name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)),
    "import": (lambda directory: (directory / record.CONFIG).is_file(),
               "a run directory (one with config.yaml)", _imported),
}


def _check_out(out, source, overwrite: bool, kind: str = "export") -> pathlib.Path:
    """Refuse, before anything is written, an --out that must not be written (outputs.check_out: empty,
    the current or home directory or one holding them, a file), one that is the source directory, holds it,
    or lies inside it (new or not: an export inside a run directory becomes part of what it reads, e.g.
    RUN/checkpoints/99 a checkpoint that is none), an existing one without --overwrite, and with it one
    that is not this kind's output (`kind` "export": a config.json of ours; "import": a run directory)."""
    if not str(out).strip():
        raise ConvertError("--out is empty; name the directory to write")
    out = out if storage.is_url(out) else pathlib.Path(out)  # a URL: gs://bucket/dir (no local source inside)
    if source is not None and not storage.is_url(out) and not storage.is_url(source):
        o, s = out.resolve(), pathlib.Path(source).resolve()
        relation = "is" if o == s else "contains" if o in s.parents else "lies inside" if s in o.parents else None
        if relation:
            raise ConvertError(f"--out {out} {relation} the source directory {source}; choose an --out outside "
                               f"it (nothing was written or deleted)")
    ours, what, made = _OURS[kind]
    out = outputs.check_out(out, overwrite, ours=ours, what=what, hidden=True, error=ConvertError, made=made)
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConvertError(f"{out} already exists; choose another --out or pass --overwrite")
    return out


def export(params: dict, gpt_config, out, fmt: str = "torch", tokenizer=None, overwrite: bool = False,
           source=None) -> str:
    """Write params (a pure dict) of a model.GPTConfig (or dict) into `out` in `fmt` ('torch' or 'hf').
    `source`: the run directory they came from, which `out` must not overlap. Returns the layout
    written: 'torch' or the transformers model_type (`hf_format`)."""
    full = dataclasses.asdict(gpt_config) if dataclasses.is_dataclass(gpt_config) else dict(gpt_config)
    names = {f.name for f in dataclasses.fields(GPTConfig)}
    c = GPTConfig(**{k: v for k, v in full.items() if k in names})
    layout = "torch" if fmt == "torch" else hf_format(c) if fmt == "hf" else None
    if layout is None:
        raise ConvertError(f"--format must be torch or hf, got {fmt!r}")
    out = _check_out(out, source, overwrite)
    tensors = to_torch_tensors(params, c, layout)  # before touching `out`: a refusal leaves it alone
    with outputs.StagedDir(out, replace=overwrite, hidden=True, last=CONFIG_NAME) as staged:  # swapped in whole
        tmp = staged.path
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        storage.plain_mode(tmp / WEIGHTS_NAME)  # readable as the other files are, not owner-only
        tok = pathlib.Path(tokenizer) if tokenizer else None
        eot_id, eot = _eot(tok) if tok else (None, None)
        meta = {"format": "torch", "load_with": TORCH_LOAD} if layout == "torch" else hf_config(c, layout, eot_id)
        meta["gpt_jax"] = full
        (tmp / CONFIG_NAME).write_text(json.dumps(meta, indent=2) + "\n")
        if tok is not None and tok.is_file():
            shutil.copyfile(tok, tmp / TOKENIZER_NAME)
            if layout != "torch":  # what AutoTokenizer needs besides tokenizer.json
                special = {f"{k}_token": eot for k in ("bos", "eos", "unk")} if eot else {}
                # the training context, for every layout: the length lm-eval's HF backend scores windows of
                # when config.json names none (BLOOM's), and eval.py's adapter's default; ALiBi and rotary
                # models still run on longer inputs
                (tmp / HF_TOKENIZER_CONFIG).write_text(json.dumps(
                    {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": c.block_size,
                     "add_prefix_space": False, **special}, indent=2) + "\n")
        staged.commit()
    return layout


def export_adapter(adapters: dict, gpt_config, lora, out, overwrite: bool = False, source=None,
                   base: str | None = None) -> str:
    """Write a LoRA run's adapters (Run.load_adapters: lora.split's tree) of a model.GPTConfig and
    config.LoRAConfig into `out` as a PEFT LoRA adapter for the base model in its transformers layout
    (hf_layouts.lora_tensors): adapter_model.safetensors and adapter_config.json (r, lora_alpha,
    lora_dropout, target_modules; PEFT's scale lora_alpha / r is the run's alpha / rank). `base`: what
    base_model_name_or_path names. Returns the layout (the transformers model_type)."""
    import model as model_lib
    from layers import lora as lora_lib

    c = gpt_config if isinstance(gpt_config, GPTConfig) else GPTConfig(**dict(gpt_config))
    layout = hf_format(c, adapters=True)
    out = _check_out(out, source, overwrite, "adapter")
    tensors, targets, conv1d = lora_tensors(lora_lib.factors(adapters, model_lib.adapted_kernels(c, lora)), c, layout)
    meta = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": lora.rank,
            "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": targets, "bias": "none",
            "fan_in_fan_out": conv1d, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
            "modules_to_save": None, "inference_mode": True}
    with outputs.StagedDir(out, replace=overwrite, hidden=True, last=ADAPTER_CONFIG) as staged:
        save_file(tensors, str(staged.path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        storage.plain_mode(staged.path / ADAPTER_WEIGHTS)
        (staged.path / ADAPTER_CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
        staged.commit()
    return layout


HF_READ = (CONFIG_NAME, TOKENIZER_NAME, "vocab.json", "merges.txt")  # what an import reads, with the weights


def fetch_hf_dir(url: str, scratch: pathlib.Path) -> pathlib.Path:
    """The files of a transformers directory at a URL (gs://...) that an import reads, copied into
    `scratch`: config.json, the tokenizer's files and the weights (model*.safetensors, else
    pytorch_model.bin); the rest (other weight formats, READMEs) stays where it is."""
    fs, path = storage.filesystem(url, error=ConvertError)

    def one_line(e: Exception) -> str:
        return storage.os_problem(e) or storage.one_line(e)

    try:
        files = {info["name"].rstrip("/").rsplit("/", 1)[-1]: info["name"] for info in fs.ls(path, detail=True)
                 if info["type"] == "file"} if fs.isdir(path) else {}
    except Exception as e:  # no access, no network
        raise ConvertError(f"cannot list {url}: {one_line(e)}") from None
    weights = sorted(n for n in files if fnmatch.fnmatch(n, "model*.safetensors")) or \
        [n for n in files if n == "pytorch_model.bin"]
    for name in [n for n in HF_READ if n in files] + weights:
        try:
            fs.get_file(files[name], str(scratch / name))
        except Exception as e:  # a full local disk, a lost connection
            raise ConvertError(f"cannot copy {url}/{name} to {scratch}: {one_line(e)}") from None
    return scratch


def import_hf(hf_dir, out, overwrite: bool = False) -> dict:
    """A transformers directory (GPT-2, BLOOM, GPT-J, GPT-NeoX, OPT, LLaMA, or our own hf export) -> a run directory
    with config.yaml, tokenizer.json (when the directory has a tokenizer), chat_template.jinja (when it has a chat
    template) and a step-0 checkpoint of params.
    A directory at a URL (gs://...) is copied into a temporary local directory first, and named by its
    URL in what is said of it."""
    if storage.is_url(hf_dir):
        url = str(hf_dir).rstrip("/")
        _check_out(out, None, overwrite, "import")  # before the copy
        with tempfile.TemporaryDirectory(prefix="import-hf-") as scratch:
            local = fetch_hf_dir(url, pathlib.Path(scratch))
            try:
                return import_hf(local, out, overwrite)
            except ConvertError as e:
                raise ConvertError(str(e).replace(str(local), url)) from None
    hf_dir = pathlib.Path(storage.local_path(hf_dir))
    out = _check_out(out, hf_dir, overwrite, "import")
    if not (hf_dir / CONFIG_NAME).is_file():
        raise ConvertError(f"{hf_dir} is not a transformers checkpoint directory: no {CONFIG_NAME}")
    try:
        meta = json.loads((hf_dir / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConvertError(f"{hf_dir / CONFIG_NAME} is not readable JSON ({e})") from None
    c, layout = config_from_hf(meta, str(hf_dir / CONFIG_NAME))
    tokenizer = read_hf_tokenizer(hf_dir)  # before anything is written: a broken one stops the import
    template = read_chat_template(hf_dir)  # serve.py's chat requests and data.py's conversations render with it
    tensors = read_hf_tensors(hf_dir)
    wte_key, lm_key = embedding_key(layout), head_key(layout)
    if c.tie_embeddings and lm_key in tensors:  # saved by some versions; must equal the tied embedding
        lm_head = tensors.pop(lm_key)
        if wte_key in tensors and not np.array_equal(lm_head, tensors[wte_key]):
            raise ConvertError(f"{hf_dir}: {lm_key} differs from {wte_key}, but config.json ties them")
    buffers = (".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq")
    for k in [k for k in tensors if k.endswith(buffers)]:
        tensors.pop(k)  # causal masks and rotary frequencies of older checkpoints: buffers, not parameters
    params = from_torch_tensors(tensors, c, layout, str(hf_dir))
    # the run's config: conf/config.yaml's settings, as train.py reads them, with the imported model, whose
    # own context (training.seq_len null) the file's seq_len, set for its model, must not cut
    base = config_lib.load_config(config_lib.DEFAULT_CONFIG)
    run_cfg = dataclasses.replace(base, run_dir=str(out), model_name=f"imported-{layout}", model=c,
                                  training=dataclasses.replace(base.training, seq_len=None))
    with contextlib.ExitStack() as held, \
            outputs.StagedDir(out, replace=overwrite, hidden=True, last=record.CONFIG) as staged:
        if out.is_dir() and any(out.iterdir()):  # --overwrite of a run: not while a process writes it
            held.enter_context(rundir.Run(out).writer("convert_torch.py --import-hf --overwrite"))
        tmp = staged.path
        run = rundir.Run(tmp)
        run.record.save_config(run_cfg)
        if isinstance(tokenizer, pathlib.Path):  # the directory's tokenizer.json, as it is
            shutil.copyfile(tokenizer, tmp / TOKENIZER_NAME)
        elif tokenizer is not None:
            tokenizer.save(str(tmp / TOKENIZER_NAME))
        if template is not None:
            from core import chat
            (tmp / chat.CHAT_TEMPLATE).write_text(template, encoding="utf-8")
        try:
            run.weights.save_params(params, step=0)  # a failed write (a full disk) is a RunError with the reason
        except Exception as e:  # said of --out, not of the staging directory's checkpoint
            reason = storage.os_problem(e)
            if reason is None:
                raise
            raise storage.StorageError(f"cannot write {out}: {reason}") from None
        staged.commit()
    return params


# ----------------------------------------------------------------------------------------------
# Command line


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out = storage.local_path(args.out)  # file:///x is the local directory /x, for writers as for readers
    if args.import_hf:
        if args.base is not None:
            raise ConvertError("--base names where a LoRA run's base model is now, for reading that run (--checkpoint "
                               "RUN_DIR); an import reads no run: leave it out")
        import_hf(args.import_hf, args.out, args.overwrite)
        imported = rundir.Run(args.out)  # a local path or a URL
        has_tokenizer = imported.dir.is_file(TOKENIZER_NAME)
        if not has_tokenizer:
            print(f"warning: {args.import_hf} has no tokenizer ({TOKENIZER_NAME}, or vocab.json and merges.txt), so "
                  f"{args.out} has none: prepare data with the model's own (python data.py --tokenizer "
                  f"PATH/{TOKENIZER_NAME}) and copy it into {args.out} for sample.py and eval.py", file=sys.stderr)
        context = imported.record.config().model.block_size
        run, name = args.out.rstrip("/"), pathlib.PurePath(args.out.rstrip("/")).name
        data_dir = f"data/{name}"
        tokenizer = run if has_tokenizer else f"PATH/{TOKENIZER_NAME}"
        print(f"imported {args.import_hf} into run directory {args.out} (step 0), context {context} tokens (what its "
              f"config.json names, or its family's default where it names none; train on shorter windows with "
              f"training.seq_len=N). Fine-tune it (the run takes the imported model) on your text files, with a "
              f"fine-tuning learning rate (conf/config.yaml's is for training from scratch) and steps to suit "
              f"your data:\n"
              f"  python data.py --input 'TEXT/*.txt' --out {shlex.quote(data_dir)} --tokenizer {shlex.quote(tokenizer)}\n"
              f"  python train.py training.init_from={shlex.quote(run)} data.dir={shlex.quote(data_dir)} "
              f"run_dir={shlex.quote(run + '-tuned')} {FINE_TUNING}\n"
              f"or train low-rank adapters on it, frozen (LoRA: a fraction of the memory):\n"
              f"  python train.py training.init_from={shlex.quote(run)} data.dir={shlex.quote(data_dir)} "
              f"run_dir={shlex.quote(run + '-lora')} training.lora.rank=8 {LORA_TUNING}")
        return 0
    args.checkpoint = storage.local_path(args.checkpoint)  # file:///x: the local run directory /x
    source = None if storage.is_url(args.checkpoint) else args.checkpoint
    _check_out(args.out, source, args.overwrite, "adapter" if args.format == "peft" else "export")  # before reading
    if args.format == "peft":
        return _export_adapter(args, source)
    run = rundir.existing(args.checkpoint, args.base)
    tokenizer_json = run.record.tokenizer_json() if run.dir.is_file(TOKENIZER_NAME) else None  # checked, first
    cfg, params, step = read_run(args.checkpoint, args.step, args.base)
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = pathlib.Path(scratch) / TOKENIZER_NAME  # the run's, as checked (a bucket's through this copy)
        if tokenizer_json is not None:
            tokenizer.write_bytes(tokenizer_json)
        layout = export(params, cfg.model, args.out, args.format, tokenizer, args.overwrite, source)
    how = {"torch": "from torch_gpt import GPT; GPT.from_pretrained(DIR)"}.get(
        layout, f"transformers.AutoModelForCausalLM.from_pretrained(DIR) ({layout} layout)")
    print(f"wrote step {step} of {args.checkpoint} to {args.out}; load with {how}")
    return 0


def _export_adapter(args, source) -> int:
    """--format peft: the LoRA run's adapters as a PEFT adapter, and how to load it."""
    run = rundir.existing(args.checkpoint, args.base)
    cfg = run.record.config()
    if cfg.training.lora is None:
        raise ConvertError(f"{args.checkpoint} is not a LoRA run (training.lora is null), so it has no adapters; "
                           f"export its model with --format hf")
    hf_format(cfg.model, adapters=True)  # a model no transformers layout expresses: refused before reading
    adapters, step = run.weights.load_adapters(args.step)
    base = str(run.weights.base_location())
    layout = export_adapter(adapters, cfg.model, cfg.training.lora, args.out, args.overwrite, source)
    print(f"wrote the LoRA adapters of step {step} of {args.checkpoint} to {args.out} (PEFT, {layout} layout); load "
          f"with peft.PeftModel.from_pretrained(BASE_MODEL, {shlex.quote(args.out)}), BASE_MODEL being its base in the "
          f"transformers layout: the model {base} was imported from, or its export: python convert_torch.py "
          f"--checkpoint {shlex.quote(base)} --format hf --out BASE")
    return 0


def cli(argv=None) -> int:
    """main() with user errors as one `error: ...` line on stderr and exit status 2, and Ctrl-C, SIGTERM and
    SIGHUP as outputs.stoppable handles them: a stop before the output is in place leaves nothing written,
    one after it is said after the output's line."""
    def stoppable_main(argv):
        return outputs.stoppable(main, argv, parse_args(argv).out, error=ConvertError,
                                 restore=__name__ != "__main__")  # run as a program, the process ends with it
    return errors.run_cli(stoppable_main, argv)


if __name__ == "__main__":
    exit_status = cli()
    for stream in (sys.stdout, sys.stderr):  # all said: the process ends now (outputs.Stops)
        with contextlib.suppress(OSError, ValueError):  # a reader that has gone, a closed stream
            stream.flush()
    os._exit(exit_status)
