"""The training's config: its sections (dataclasses), YAML in conf/, its overrides, its rules (validation).

    conf/config.yaml ──read_yaml──> nested dict ──key=value overrides──> Config (dataclasses)
    Config ──to_dict──> RUN_DIR/config.yaml (model fully resolved; rundir.Run.save_config)
    RUN_DIR/config.yaml ──from_saved──> Config (record.Record.config; the size table is not read)

`model` in a config file is either a named size from conf/model_config.yaml (`model: small`) or a
mapping `{name: small, <GPTConfig field>: value, ...}` whose fields override the named size. A
mapping whose name is not a known size must give the architecture itself (vocab_size,
block_size, embedding_dim, num_head, N), so a typo in a name never falls back to some default.
The effective config written into a run directory holds every GPTConfig field, so eval, sample
and convert need nothing but that directory: reading it back (from_saved) never consults the size
table, which may have changed since the run was made.

Every user mistake (unknown key, wrong type, unknown model size, a missing file) raises
`ConfigError` with one line that names the problem and the valid choices. The machinery that reads
typed values from YAML (a field's annotation its check, the dotted overrides into a section, the YAML
files) is core/typed_config.py's and knows nothing of these sections; this module holds what a
training config is: its sections and keys, the model sizes, the cross-field rules.
"""
from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import re
import typing

import yaml

import sharding
from core import typed_config as typed
from core.errors import ConfigError
from model import GPTConfig
from tokendata.shards import BATCHING

CONF_DIR = pathlib.Path(__file__).resolve().parent.parent / "conf"
DEFAULT_CONFIG = CONF_DIR / "config.yaml"
MODEL_SIZES = CONF_DIR / "model_config.yaml"


@dataclasses.dataclass
class SourceConfig:
    """One source of a mixture: a prepared data directory and its weight among the sources."""
    dir: typing.Optional[str] = None  # a prepared data directory (a local path or a URL)
    weight: float = 1.0  # its share relative to the other sources' weights (normalised)


@dataclasses.dataclass
class StageConfig:
    """Other weights of a mixture's sources from step `step` on (e.g. a final anneal on the best data)."""
    step: int = 0
    weights: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class DataConfig:
    dir: typing.Optional[str] = None  # prepared data directory; None = the built-in default corpus
    batching: str = "packing"  # prompt/completion data: packing (several examples a row) | padding (one)
    mixture: typing.Optional[dict[str, SourceConfig]] = None  # several directories mixed by weight, by name
    stages: list[StageConfig] = dataclasses.field(default_factory=list)  # the mixture's weights from a step on
    max_epochs: typing.Optional[float] = None  # refuse a run that repeats a source more often than this

    OPTIONAL = ("mixture", "stages", "max_epochs")  # (not a field) written into a run's config only when set


@dataclasses.dataclass
class LoRAConfig:
    """Low-rank adapters (Hu et al. 2021) on the frozen weights of training.init_from's model: each chosen
    projection W becomes W + (alpha / rank) * A @ B, with A (in, rank) and B (rank, out) the only trained
    parameters; B starts at zero, so step 0 is the base model exactly."""
    rank: int = 8  # r, the inner dimension of A @ B
    alpha: float = 16.0  # the update is scaled by alpha / rank (PEFT's lora_alpha)
    dropout: float = 0.0  # dropout on the adapters' input (PEFT's lora_dropout)
    targets: typing.List[str] = dataclasses.field(default_factory=lambda: ["q", "v"])  # of TARGETS
    base_dtype: typing.Optional[str] = None  # the frozen weights held in: float32 (None) | bfloat16 | float16

    # (class attributes, not fields) the projections an adapter may sit on: attention's query, key, value
    # and output projections, and every weight of the MLP
    TARGETS = ("q", "k", "v", "o", "mlp")
    BASE_DTYPES = ("float32", "bfloat16", "float16")
    # what the adapters' parameters depend on: a resume may not change these (the dropout and the base's dtype
    # say how the run computes, and may)
    SHAPE_FIELDS = ("rank", "alpha", "targets")


@dataclasses.dataclass
class DPOConfig:
    """Direct preference optimisation (Rafailov et al. 2023) on prompt/chosen/rejected pairs: the loss of a pair
    is -(1 - label_smoothing) log sigmoid(beta * d) - label_smoothing log sigmoid(-beta * d), with d the policy's
    log-probability ratio to the reference of the chosen response minus that of the rejected one."""
    beta: float = 0.1  # how far the policy may move from the reference (TRL's beta)
    label_smoothing: float = 0.0  # the assumed share of flipped preferences (conservative DPO), in [0, 0.5)
    # the reference's log-probabilities of every pair computed once at the start and kept in the run directory
    # (RUN/reference_logps.npz), instead of a forward pass of the reference in each step
    precompute_reference: bool = False


@dataclasses.dataclass
class TrainingConfig:
    steps: int = 3000
    batch_size: int = 32  # global, in sequences
    micro_batches: int = 1  # gradient accumulation: batch_size is split into this many pieces
    seq_len: typing.Optional[int] = None  # None = model.block_size
    lr: float = 3e-3
    min_lr: float = 3e-4  # where cosine and wsd end
    warmup_steps: int = 100
    schedule: str = "cosine"  # the learning rate after the warm-up, one of SCHEDULES (step.lr_schedule)
    decay_fraction: float = 0.2  # wsd: the last fraction of the steps, in which the learning rate decays to min_lr
    weight_decay: float = 0.1
    decay_embeddings: bool = False
    # adamw everywhere, or muon for the blocks' weight matrices and AdamW for the rest (step.make_optimizer);
    # a run saved without the key (before it existed) is an AdamW run
    optimizer: str = "adamw"
    muon_momentum: float = 0.95  # Muon's momentum (its one moment), Nesterov-style
    muon_rms: float = 0.2  # Muon's updates scaled to this RMS (AdamW's typical one), so they share training.lr
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: typing.Optional[float] = 1.0  # None = no clipping
    log_every: int = 10
    eval_every: int = 250
    eval_windows: int = 256
    init_from: typing.Optional[str] = None  # a run directory whose last checkpoint's params start this run
    fcm_max_ratio: float = 0.0  # forgetful causal masking: hide up to this fraction of past tokens; 0 = off
    # the loss over at most this many tokens per device at a time; 0 = the whole logits; auto = the whole
    # logits where they fit in 1/8 of a device's memory, else 4096 (loss.resolve_chunk)
    loss_chunk: typing.Union[int, str] = "auto"
    lora: typing.Optional[LoRAConfig] = None  # low-rank adapters on init_from's frozen model; None: train every weight
    # lm: next-token loss (on the completions of prompt/completion data); dpo: preference pairs against the
    # reference, init_from's model (training.dpo's settings); a run saved without the key is an lm run
    objective: str = "lm"
    dpo: typing.Optional[DPOConfig] = None  # training.objective=dpo's settings; None = DPOConfig's defaults

    # (a class attribute, not a field) the learning-rate schedules after the linear warm-up: cosine down to min_lr
    # at `steps`; warm-up, stable, decay (flat at lr, then down to min_lr over the last decay_fraction); flat at lr
    SCHEDULES = ("cosine", "wsd", "constant")
    OPTIMIZERS = ("adamw", "muon")  # (a class attribute too) training.optimizer's values
    OBJECTIVES = ("lm", "dpo")  # training.objective's values

    @property
    def dpo_settings(self) -> DPOConfig:
        """training.dpo, or its defaults where the section is not given."""
        return self.dpo if self.dpo is not None else DPOConfig()


@dataclasses.dataclass
class CheckpointConfig:
    every: int = 500
    keep: int = 3
    async_save: bool = True


@dataclasses.dataclass
class ShardingConfig:
    data: int = -1  # data-parallel mesh axis size; -1 = the devices the other axes leave
    fsdp: int = 1  # second data-parallel axis, nearer devices (stage-3 gathers); -1 allowed
    tensor: int = 1  # tensor-parallel axis: heads, MLP width and vocabulary split; -1 allowed
    zero_stage: int = 0  # 0 replicated | 1 optimizer state | 2 + gradients | 3 + parameters sharded


@dataclasses.dataclass
class WandbConfig:
    mode: str = "disabled"  # disabled | offline | online
    project: str = "gpt-jax"
    entity: typing.Optional[str] = None
    name: typing.Optional[str] = None


@dataclasses.dataclass
class Config:
    run_dir: str = "runs/default"
    seed: int = 0
    model_name: str = "small"  # the named size (or label) the model came from
    model: GPTConfig = dataclasses.field(default_factory=GPTConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    sharding: ShardingConfig = dataclasses.field(default_factory=ShardingConfig)
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)

    @property
    def seq_len(self) -> int:
        return self.training.seq_len or self.model.block_size

    @property
    def sequences_per_row(self) -> int:
        """Sequences of seq_len a batch row holds: 2 for DPO (a row's chosen side and its rejected side), else 1."""
        return 2 if self.training.objective == "dpo" else 1

    @property
    def tokens_per_step(self) -> int:
        return self.training.batch_size * self.sequences_per_row * self.seq_len


SECTIONS = {"data": DataConfig, "training": TrainingConfig, "checkpoint": CheckpointConfig,
            "sharding": ShardingConfig, "wandb": WandbConfig}
TOP_LEVEL_KEYS = ("run_dir", "seed", "model", *SECTIONS)
WANDB_MODES = ("disabled", "offline", "online")
# the override a mistake in a key's list or mapping shows (typed_config.parse_override), where not the generic one
OVERRIDE_EXAMPLES = {"data.stages": "'data.stages=[{step: 300, weights: {a: 1, b: 0}}]'"}


# ----------------------------------------------------------------------------------------------
# Model sizes


def load_model_sizes(path=None) -> dict[str, dict]:
    """The named sizes of conf/model_config.yaml (or `path`): name -> {GPTConfig field: value}."""
    path = pathlib.Path(MODEL_SIZES if path is None else path)
    if not path.is_file():
        raise ConfigError(f"model size table {path} not found")
    try:
        sizes = typed.load_yaml(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(sizes, dict):
        raise ConfigError(f"{path} must map size names to GPTConfig fields")
    return {str(k): v for k, v in sizes.items()}


def resolve_model(spec, sizes: dict[str, dict]) -> tuple[str, GPTConfig]:
    """(name, GPTConfig) from `model: NAME` or `model: {name: NAME, field: value, ...}`."""
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, dict):
        raise ConfigError(f"model must be a size name ({', '.join(sizes)}) or a mapping, got {spec!r}")
    spec = dict(spec)
    name = spec.pop("name", None)
    if name is not None and not isinstance(name, str):
        name = str(name)  # e.g. `model: {name: 760m}` is a string already; `name: 125` is not
    if name in sizes:
        base = dict(sizes[name])
    elif all(k in spec for k in GPTConfig.REQUIRED_FIELDS):
        base, name = {}, name or "custom"
    elif not sizes:  # a run's saved config (from_saved), which names no size but gives the model whole
        raise ConfigError(f"model {name!r} is not given whole: a run's config.yaml sets every model field "
                          f"({', '.join(GPTConfig.REQUIRED_FIELDS)} at least)")
    else:
        raise ConfigError(
            f"unknown model size {name!r}; valid sizes: {', '.join(sizes)} "
            f"(or a mapping that sets {', '.join(GPTConfig.REQUIRED_FIELDS)})"
        )
    try:
        model = typed.build(GPTConfig, {**base, **spec}, "model")
    except ValueError as e:  # GPTConfig.__post_init__ checks ranges and choices
        raise ConfigError(str(e)) from None
    return name, model


# ----------------------------------------------------------------------------------------------
# Overrides: key=value on the command line


def apply_overrides(raw: dict, overrides: typing.Sequence[str]) -> dict:
    """A copy of the raw config dict with the dotted overrides applied (checked later by from_dict)."""
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for i, text in enumerate(overrides):
        path, value = typed.parse_override(text, overrides[i + 1] if i + 1 < len(overrides) else None,
                                           OVERRIDE_EXAMPLES)
        top = path[0]
        if top not in TOP_LEVEL_KEYS:
            raise ConfigError(f"unknown key {top!r} in override {text!r}; valid keys: {', '.join(TOP_LEVEL_KEYS)}")
        if top == "model":
            if len(path) == 1:
                if isinstance(value, dict):
                    raw["model"] = value
                elif isinstance(raw.get("model"), dict):  # replace the name, keep the field overrides
                    raw["model"] = {**raw["model"], "name": value}
                else:
                    raw["model"] = value
            elif len(path) == 2:
                model = raw.get("model")
                model = dict(model) if isinstance(model, dict) else {"name": model}
                model[path[1]] = value
                raw["model"] = model
            else:
                raise ConfigError(f"override {text!r}: model takes one level (model.FIELD=VALUE)")
        elif top in SECTIONS:
            typed.set_in_section(raw, SECTIONS[top], path, value, text)
        else:
            if len(path) != 1:
                raise ConfigError(f"override {text!r}: {top} has no sub-keys")
            raw[top] = value
    return raw


# ----------------------------------------------------------------------------------------------
# Config from a dict or a file


def from_dict(raw: dict, *, sizes: dict[str, dict] | None = None) -> Config:
    """A validated Config from a raw nested dict (as read from YAML)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a mapping with keys {', '.join(TOP_LEVEL_KEYS)}")
    unknown = [k for k in raw if k not in TOP_LEVEL_KEYS]
    if unknown:
        raise ConfigError(f"unknown key {unknown[0]!r}; valid keys: {', '.join(TOP_LEVEL_KEYS)}")
    top = typed.fields(Config)
    cfg = Config(
        run_dir=typed.check_value("run_dir", raw.get("run_dir", Config.run_dir), top["run_dir"]),
        seed=typed.check_value("seed", raw.get("seed", Config.seed), top["seed"]),
        **{name: typed.build(cls, raw.get(name), name) for name, cls in SECTIONS.items()},
    )
    cfg.model_name, cfg.model = resolve_model(raw.get("model", "small"), load_model_sizes() if sizes is None else sizes)
    # paths a user types as `key=~/x`, where the shell leaves the ~ alone: the home directory, as the shell would
    cfg.run_dir = _home(cfg.run_dir)
    cfg.data.dir = _home(cfg.data.dir)
    for source in (cfg.data.mixture or {}).values():
        source.dir = _home(source.dir)
    cfg.training.init_from = _home(cfg.training.init_from)
    validate(cfg)
    return cfg


def _home(path: str | None) -> str | None:
    """`~` or `~user` at the start of a local path expanded (os.path.expanduser); URLs and None as they are."""
    return os.path.expanduser(path) if isinstance(path, str) and path.startswith("~") else path


def from_saved(raw: dict) -> Config:
    """A run directory's config.yaml (with any overrides applied): its model section holds every field
    (to_dict wrote it so), which is read as it is. This checkout's size table (conf/model_config.yaml) is
    never consulted: its entry under the run's model_name may have changed, gone, or gained fields since."""
    return from_dict(raw, sizes={})


def validate(cfg: Config) -> None:
    """Cross-field checks that a single type check cannot make."""
    t = cfg.training
    if not -2**63 <= cfg.seed < 2**63:  # core/seeds.py's keys and the loader's permutation take a 64-bit seed
        raise ConfigError(f"seed must be a 64-bit integer (between -2**63 and 2**63 - 1), got {cfg.seed}")
    # counts the step computes with (as int32 on the device): at least 1, below 2**31
    for section, key in [("training", k) for k in ("steps", "batch_size", "micro_batches", "log_every",
                                                  "eval_every", "eval_windows")] + [("checkpoint", "every"),
                                                                                    ("checkpoint", "keep")]:
        value = getattr(getattr(cfg, section), key)
        if not 1 <= value < 2**31:
            raise ConfigError(f"{section}.{key} must be >= 1 and below 2**31, got {value}")
    if not 0 <= t.warmup_steps < 2**31:
        raise ConfigError(f"training.warmup_steps must be >= 0 and below 2**31, got {t.warmup_steps}")
    if isinstance(t.loss_chunk, int) and t.loss_chunk >= 2**31:
        raise ConfigError(f"training.loss_chunk must be below 2**31, got {t.loss_chunk}")
    if t.batch_size % t.micro_batches:
        raise ConfigError(
            f"training.batch_size ({t.batch_size}) must be divisible by training.micro_batches ({t.micro_batches})"
        )
    if t.seq_len is not None and not 1 <= t.seq_len <= cfg.model.block_size:
        raise ConfigError(f"training.seq_len must be in 1..model.block_size ({cfg.model.block_size}), got {t.seq_len}")
    if not (math.isfinite(t.lr) and t.lr >= 0):  # 0: no updates (e.g. to measure a starting point)
        raise ConfigError(f"training.lr must be a number >= 0, got {t.lr}")
    check_schedule(t)
    try:
        sharding.check_sizes(cfg.sharding.data, cfg.sharding.fsdp, cfg.sharding.tensor)
        sharding.check_zero_stage(cfg.sharding.zero_stage)
    except sharding.ShardingError as e:
        raise ConfigError(str(e)) from None
    if t.grad_clip is not None and not (math.isfinite(t.grad_clip) and t.grad_clip > 0):
        raise ConfigError(f"training.grad_clip must be a positive gradient norm, or null for no clipping; "
                          f"got {t.grad_clip}")
    if t.optimizer not in TrainingConfig.OPTIMIZERS:
        raise ConfigError(f"training.optimizer must be one of {', '.join(TrainingConfig.OPTIMIZERS)}, "
                          f"got {t.optimizer!r}")
    if not 0.0 <= t.muon_momentum < 1.0:
        raise ConfigError(f"training.muon_momentum must be in [0, 1), got {t.muon_momentum}")
    if not (math.isfinite(t.muon_rms) and t.muon_rms > 0):
        raise ConfigError(f"training.muon_rms must be a positive number, got {t.muon_rms}")
    for key in ("b1", "b2"):  # AdamW's decay rates of the moments
        if not 0.0 <= getattr(t, key) < 1.0:
            raise ConfigError(f"training.{key} must be in [0, 1), got {getattr(t, key)}")
    if not (math.isfinite(t.eps) and t.eps > 0):
        raise ConfigError(f"training.eps must be a positive number, got {t.eps}")
    if not (math.isfinite(t.weight_decay) and t.weight_decay >= 0):
        raise ConfigError(f"training.weight_decay must be >= 0, got {t.weight_decay}")
    if not 0.0 <= t.fcm_max_ratio < 1.0:
        raise ConfigError(f"training.fcm_max_ratio must be in [0, 1), got {t.fcm_max_ratio}")
    if t.loss_chunk != "auto" and (not isinstance(t.loss_chunk, int) or isinstance(t.loss_chunk, bool)
                                   or t.loss_chunk < 0):
        raise ConfigError(f"training.loss_chunk must be auto or an integer >= 0 (0: the loss over the whole "
                          f"logits), got {t.loss_chunk!r}")
    eps = cfg.model.layer_norm_epsilon  # added to the variance: NaN or <= 0 would surface as a NaN loss at step 1
    if not (math.isfinite(eps) and eps > 0):
        raise ConfigError(f"model.layer_norm_epsilon must be a positive number, got {eps}")
    if t.lora is not None:
        check_lora(t.lora, t.init_from, cfg.model)
    check_dpo(t)
    if cfg.data.batching not in BATCHING:
        raise ConfigError(f"data.batching must be one of {', '.join(BATCHING)}, got {cfg.data.batching!r}")
    check_mixture(cfg.data, t.steps)
    if cfg.wandb.mode not in WANDB_MODES:
        raise ConfigError(f"wandb.mode must be one of {', '.join(WANDB_MODES)}, got {cfg.wandb.mode!r}")


def check_schedule(t: TrainingConfig) -> None:
    """training.schedule and the keys it reads: min_lr within [0, lr] (constant has no use for it), and wsd's
    decay (the last decay_fraction of the steps) after its warm-up."""
    if t.schedule not in TrainingConfig.SCHEDULES:
        raise ConfigError(f"training.schedule must be one of {', '.join(TrainingConfig.SCHEDULES)}, got {t.schedule!r}")
    if t.schedule != "constant" and not 0.0 <= t.min_lr <= t.lr:
        raise ConfigError(f"training.min_lr ({t.min_lr}) must be in [0, training.lr ({t.lr})]")
    if not 0.0 < t.decay_fraction <= 1.0:
        raise ConfigError(f"training.decay_fraction must be in (0, 1] (wsd decays over that fraction of the steps), "
                          f"got {t.decay_fraction}")
    decay = t.decay_fraction * t.steps
    if t.schedule == "wsd" and decay < 1:  # a decay within the last step: the rate would fall at the end alone
        raise ConfigError(f"training.schedule=wsd: training.decay_fraction {t.decay_fraction:g} of {t.steps} steps is "
                          f"{decay:g} steps; the decay needs at least one step (decay_fraction >= {1 / t.steps:g})")
    if t.schedule == "wsd" and t.warmup_steps + decay > t.steps * (1 + 1e-9):  # (the float product's rounding)
        raise ConfigError(f"training.schedule=wsd: the warm-up (training.warmup_steps {t.warmup_steps}) and the decay "
                          f"(training.decay_fraction {t.decay_fraction:g} of {t.steps} steps: {decay:g}) are longer "
                          f"than training.steps ({t.steps}); lower one of them or raise the steps"
                          + (" (a decay_fraction of 1 decays over every step, leaving none for a warm-up: with "
                             "training.warmup_steps above 0 it must be below 1)" if t.decay_fraction == 1 else ""))


SOURCE_NAME = re.compile(r"[A-Za-z0-9_-]+")  # a source's name: a metrics key (val_loss/NAME) and an override's part


def check_mixture(data: DataConfig, steps: int) -> None:
    """data.mixture and data.stages, checked before anything is made: one source form (data.dir or a
    mixture), named sources with a directory each, weights that are numbers >= 0 and not all zero, and
    stages in step order inside the run, each weighing every source."""
    if data.mixture is None:
        if data.stages:
            raise ConfigError("data.stages changes the weights of data.mixture's sources; this config has no "
                              "data.mixture")
        if data.max_epochs is not None:
            raise ConfigError("data.max_epochs bounds the epochs of data.mixture's sources; this config has no "
                              "data.mixture (one source: data.dir)")
        return
    if data.dir is not None:
        raise ConfigError(f"data.dir ({data.dir}) and data.mixture are both given: train on one directory "
                          f"(data.dir) or on a mixture of several (data.mixture), not both (data.dir=null)")
    if not data.mixture:
        raise ConfigError("data.mixture names no source; give each as data.mixture.NAME.dir=DIR "
                          "data.mixture.NAME.weight=W")
    names = list(data.mixture)
    for name, source in data.mixture.items():
        if not SOURCE_NAME.fullmatch(name):
            raise ConfigError(f"data.mixture: a source's name is letters, digits, _ and -, got {name!r}")
        if not source.dir:
            raise ConfigError(f"data.mixture.{name}.dir is not set: the prepared directory of source {name!r}")
    check_weights("data.mixture", {name: source.weight for name, source in data.mixture.items()})
    last = 0
    for i, stage in enumerate(data.stages):
        where = f"data.stages[{i}]"
        if stage.step <= 0:  # (also a stage given without a step: 0)
            raise ConfigError(f"{where}.step must be the step from which its weights apply, 1 to {steps - 1} "
                              f"(data.mixture's own weights are those of step 0), got {stage.step}; e.g. "
                              f"{{step: {max(steps // 2, 1)}, weights: {{...}}}}")
        if not last < stage.step < steps:
            raise ConfigError(f"{where}.step must be after the step before ({last}) and before training.steps "
                              f"({steps}), got {stage.step}")
        unknown = [n for n in stage.weights if n not in data.mixture]
        if unknown:
            raise ConfigError(f"{where} weighs {unknown[0]!r}, which is no source of data.mixture "
                              f"({', '.join(names)})")
        missing = [n for n in names if n not in stage.weights]
        if missing:
            raise ConfigError(f"{where} gives no weight to {', '.join(missing)}: a stage weighs every source "
                              f"(0 leaves one out)")
        check_weights(f"{where}.weights", stage.weights)
        last = stage.step
    if data.max_epochs is not None and not (math.isfinite(data.max_epochs) and data.max_epochs > 0):
        raise ConfigError(f"data.max_epochs must be a positive number of epochs, or null; got {data.max_epochs}")


def check_weights(where: str, weights: dict[str, float]) -> None:
    bad = [f"{n} {w}" for n, w in weights.items() if not (math.isfinite(w) and w >= 0)]
    if bad:
        raise ConfigError(f"{where}: a weight must be a number >= 0, got {bad[0]}")
    if not any(weights.values()):
        raise ConfigError(f"{where}: every weight is 0; give at least one source a positive weight")
    try:
        total = math.fsum(weights.values())
    except OverflowError:  # (fsum's own: an intermediate sum past the largest float)
        total = math.inf
    if not math.isfinite(total):
        raise ConfigError(f"{where}: the weights add up past the largest number a float holds "
                          f"({', '.join(f'{n} {w:g}' for n, w in weights.items())}); they are relative, so scale "
                          f"them down (e.g. 1 and 1)")


def mixture_stages(data: DataConfig) -> list[tuple[int, list[float]]]:
    """[(first step, the sources' weights in data.mixture's order)]: data.mixture's own from step 0, then
    each of data.stages."""
    names = list(data.mixture)
    return [(0, [data.mixture[n].weight for n in names])] + [
        (stage.step, [stage.weights[n] for n in names]) for stage in data.stages]


def mixture_change(saved: DataConfig, now: DataConfig, step: int) -> str | None:
    """Why a resume at `step` may not take the mixture `now` (None if it may): the sources (their names and
    order) and the weights of every step before `step` must be those the run had (`saved`); weights may
    change from `step` on, as a stage (data.stages) that starts there or later."""
    if saved.mixture is None or now.mixture is None:
        return None if saved.mixture is now.mixture else (
            f"--resume cannot {'mix' if now.mixture else 'unmix'} the data of a run that trained on "
            f"{'one directory' if now.mixture else 'a mixture'}; start a new run from it (training.init_from)")
    if list(saved.mixture) != list(now.mixture):
        return (f"--resume cannot change data.mixture's sources ({', '.join(saved.mixture)} -> "
                f"{', '.join(now.mixture)}); start a new run from it (training.init_from)")
    before = lambda data: [(s, w) for s, w in mixture_stages(data) if s < step or s == 0]  # noqa: E731
    if before(saved) != before(now):
        return (f"--resume at step {step} changes data.mixture's weights before it; the steps done keep theirs: "
                f"change them from step {step} on with a stage, data.stages=[..., {{step: {step}, weights: "
                f"{{{', '.join(f'{n}: W' for n in now.mixture)}}}}}]")
    return None


def check_dpo(t: TrainingConfig) -> None:
    """training.objective and training.dpo: DPO needs the model it starts from and compares with (init_from)."""
    if t.objective not in TrainingConfig.OBJECTIVES:
        raise ConfigError(f"training.objective must be one of {', '.join(TrainingConfig.OBJECTIVES)}, "
                          f"got {t.objective!r}")
    if t.objective != "dpo":
        if t.dpo is not None:
            raise ConfigError("training.dpo is set but training.objective is lm: set training.objective=dpo to "
                              "train on preference pairs, or remove training.dpo")
        return
    if not t.init_from:
        raise ConfigError("training.objective=dpo needs training.init_from: the run directory (or import) whose "
                          "model the policy starts from and the reference is")
    d = t.dpo_settings
    if not (math.isfinite(d.beta) and d.beta > 0):
        raise ConfigError(f"training.dpo.beta must be a positive number, got {d.beta}")
    if not 0.0 <= d.label_smoothing < 0.5:
        raise ConfigError(f"training.dpo.label_smoothing must be in [0, 0.5), got {d.label_smoothing}")
    if t.fcm_max_ratio:
        raise ConfigError("training.fcm_max_ratio hides tokens from the policy but not from the reference: it "
                          "does not apply to training.objective=dpo; set it to 0")


def lora_shapes(m: GPTConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of the weight each LoRA target adapts, as model.py's Dense sees it: q (d, H*D), k and v
    (d, K*D), o (H*D, d); mlp each of the MLP's weights, (d, F) and (F, d), whose narrower side is the same."""
    d, heads, kv = m.embedding_dim, m.num_head * m.head_dim, m.kv_heads * m.head_dim
    return {"q": (d, heads), "k": (d, kv), "v": (d, kv), "o": (heads, d), "mlp": (d, m.ffn_dim)}


def check_lora(lora: LoRAConfig, init_from: str | None, model: GPTConfig | None = None) -> None:
    """training.lora's values, and the base it needs (training.init_from); with `model` (the base's), a
    rank below the narrowest side of every adapted weight."""
    if not init_from:
        raise ConfigError("training.lora needs training.init_from: the run directory (or import) whose model the "
                          "adapters sit on, frozen")
    if not 1 <= lora.rank < 2**31:
        raise ConfigError(f"training.lora.rank must be >= 1, got {lora.rank}")
    if not (math.isfinite(lora.alpha) and lora.alpha > 0):
        raise ConfigError(f"training.lora.alpha must be a positive number, got {lora.alpha}")
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"training.lora.dropout must be in [0, 1), got {lora.dropout}")
    unknown = [x for x in lora.targets if x not in LoRAConfig.TARGETS]
    if unknown or not lora.targets or len(set(lora.targets)) != len(lora.targets):
        what = f"unknown target {unknown[0]!r}" if unknown else "no target" if not lora.targets else "a target twice"
        raise ConfigError(f"training.lora.targets: {what}; a list of distinct ones of {', '.join(LoRAConfig.TARGETS)}"
                          f" (attention's query, key, value and output projections, the MLP)")
    if lora.base_dtype is not None and lora.base_dtype not in LoRAConfig.BASE_DTYPES:
        raise ConfigError(f"training.lora.base_dtype must be null or one of {', '.join(LoRAConfig.BASE_DTYPES)}, "
                          f"got {lora.base_dtype!r}")
    if model is not None:  # a rank of min(in, out) or more is a full-rank update, with more parameters than W
        shapes = lora_shapes(model)
        target = min(lora.targets, key=lambda x: min(shapes[x]))
        narrowest = min(shapes[target])
        if lora.rank >= narrowest:
            n_in, n_out = shapes[target]
            raise ConfigError(f"training.lora.rank {lora.rank} is at or above min(in, out) = {narrowest} of the "
                              f"adapted {target} weight ({n_in} x {n_out}): the largest useful rank is {narrowest - 1}")


def read_yaml(path) -> dict:
    """The mapping a config file holds, or a ConfigError naming what is wrong with it (typed_config.read_yaml)."""
    return typed.read_yaml(path, TOP_LEVEL_KEYS)


def parse_yaml(text: str | bytes, path) -> dict:
    """The mapping of a config file's text; `path` names it in errors (typed_config.parse_yaml)."""
    return typed.parse_yaml(text, path, TOP_LEVEL_KEYS)


def run_dir_of(path=DEFAULT_CONFIG, overrides: typing.Sequence[str] = ()) -> str:
    """The run_dir that a config file with `overrides` names, the rest unchecked: for --resume, whose
    overrides apply to (and are checked against) the run's own saved config, not this file's."""
    raw = apply_overrides(read_yaml(path), overrides)
    return _home(typed.check_value("run_dir", raw.get("run_dir", Config.run_dir), typed.fields(Config)["run_dir"]))


def load_config(path=DEFAULT_CONFIG, overrides: typing.Sequence[str] = (), *, model: dict | None = None) -> Config:
    """The Config of a YAML file with `key=value` overrides applied; `model` (a model section, e.g.
    training.init_from's) replaces the file's, the overrides' model.FIELD=VALUE applied on top."""
    raw = read_yaml(path)
    if model is not None:
        raw = {**raw, "model": model}
    return from_dict(apply_overrides(raw, overrides))


def names_model(overrides: typing.Sequence[str]) -> bool:
    """Whether the overrides choose a model as a whole (`model=NAME`), not only some of its fields."""
    return any(text.partition("=")[0] == "model" for text in overrides)


def to_dict(cfg: Config) -> dict:
    """The effective config as plain YAML-able data, the model fully resolved."""
    return {
        "run_dir": cfg.run_dir,
        "seed": cfg.seed,
        "model": {"name": cfg.model_name, **dataclasses.asdict(cfg.model)},
        **{name: dataclasses.asdict(getattr(cfg, name)) for name in SECTIONS},
        "data": {k: v for k, v in dataclasses.asdict(cfg.data).items()  # a one-directory run's as before
                 if k not in DataConfig.OPTIONAL or v not in (None, [])},
    }
