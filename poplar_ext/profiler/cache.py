"""The profile cache: a directory of profile JSON files, looked up by what is inside them (`ProfileKey`,
`LayerProfileKey`); file names are for people only. See profiles/README.md ("The cache")."""

from __future__ import annotations

import copy
import dataclasses
import re
import tempfile
import warnings
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from poplar_ext.collectives import decided_by_rank0
from poplar_ext.plan.errors import FormatError
from poplar_ext.plan.formats import (
    Emulation,
    Levers,
    Profile,
    content_fingerprint,
    is_cluster_or_plan,
    profile_from_dict,
    read_json,
    save_profile,
    write_text_atomic,
)
from poplar_ext.plan.pipeline_formats import LayerProfile, layer_profiles_dir, load_layer_profile, save_layer_profile
from poplar_ext.profiler.sizes import sweep_sizes

if TYPE_CHECKING:
    from poplar_ext.profiler.measure import MeasureSettings
    from poplar_ext.profiler.options import ProfileOptions

# DeepSpeed settings that do not change per-micro-step speed or memory, or that the profiler sets itself (the
# scheduler: one cheap step per iteration, the same work per micro-step); everything else is in the cache key.
_CONFIG_KEYS_NOT_IN_KEY = frozenset(
    "train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps steps_per_print wall_clock_breakdown "
    "memory_breakdown tensorboard wandb csv_monitor comet poplar checkpoint scheduler".split()
)


_OPTIMIZER_PARAMS_NOT_IN_KEY = ("lr", "betas", "eps", "weight_decay")
"""Optimizer settings that change neither its state nor the cost of its step: a learning-rate sweep (the Trainer
fills ``lr: "auto"`` from --learning_rate) reuses the profiles. Others stay (momentum and amsgrad add state)."""


def client_optimizer(optimizer_factory: Callable[[list], Any] | None) -> dict[str, Any] | None:
    """The optimizer `optimizer_factory` builds (None: no factory) as a DeepSpeed config's ``optimizer`` section
    would say it, for the cache key: its class (``type``) and ``defaults`` (``params``, the JSON ones). Built
    on a parameter of its own: a model's may be many, a pipeline layer's none."""
    if optimizer_factory is None:
        return None
    import torch

    from poplar_ext.profiler.fingerprint import json_settings

    optimizer = optimizer_factory([torch.nn.Parameter(torch.zeros(1))])
    kind = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    return {"type": kind, "params": json_settings(optimizer.defaults)}


def ds_config_fingerprint(ds_config: Mapping[str, Any], client_optimizer: Mapping[str, Any] | None = None) -> str:
    """Hash of the DeepSpeed settings that change speed or memory (not batch sizes, not the stage), and of
    `client_optimizer`, an optimizer the script builds (`client_optimizer`'s result): in either optimizer's
    ``params``, those `_OPTIMIZER_PARAMS_NOT_IN_KEY` names left out."""
    relevant = {k: copy.deepcopy(v) for k, v in ds_config.items() if k not in _CONFIG_KEYS_NOT_IN_KEY}
    if client_optimizer is not None:
        relevant["poplar_client_optimizer"] = copy.deepcopy(dict(client_optimizer))
    if isinstance(relevant.get("zero_optimization"), dict):
        relevant["zero_optimization"].pop("stage", None)
    for optimizer in (relevant.get("optimizer"), relevant.get("poplar_client_optimizer")):
        if isinstance(optimizer, dict) and isinstance(optimizer.get("params"), dict):
            for name in _OPTIMIZER_PARAMS_NOT_IN_KEY:
                optimizer["params"].pop(name, None)
            if not optimizer["params"]:
                del optimizer["params"]
    # A section left empty (``zero_optimization`` that only set the stage) is absent: DeepSpeed's defaults either way.
    return content_fingerprint({k: v for k, v in relevant.items() if v != {}})


@dataclass(frozen=True, kw_only=True)
class _Key:
    """What must match for a stored profile, or layer profile, to stand for a new measurement."""

    model_fingerprint: str
    """`poplar_ext.profiler.fingerprint.model_fingerprint` of the model (of a pipeline's layers as one
    ``nn.Sequential``)."""
    device_type: str
    """Device type as normalised (`poplar_ext.hardware.devices`) or as declared emulated."""
    emulation: Emulation | None
    """The emulation of an emulated type; another slowdown or capacity is another device."""
    zero_stage: int
    dtype: str
    """``float32``, ``bfloat16`` or ``float16``."""
    sequence_length: int | None
    torch_version: str
    deepspeed_version: str
    ds_config_fingerprint: str
    """`ds_config_fingerprint` of the DeepSpeed config (its optimizer, or the script's, decides the optimizer state)."""

    @classmethod
    def of_profile(cls, profile: Any) -> Any:
        """The key of a stored profile; None for one that was not measured by this profiler."""
        provenance = profile.measured_with
        recorded = all(k in provenance for k in ("torch", "deepspeed", "ds_config_fingerprint"))
        if provenance.get("source") != "measured" or not recorded:
            return None
        return cls(
            model_fingerprint=profile.model.fingerprint,
            device_type=profile.device_type,
            emulation=profile.emulated,
            zero_stage=profile.zero_stage,
            dtype=profile.model.dtype,
            sequence_length=profile.model.sequence_length,
            torch_version=str(provenance["torch"]),
            deepspeed_version=str(provenance["deepspeed"]),
            ds_config_fingerprint=str(provenance["ds_config_fingerprint"]),
            **cls._own(profile),
        )


@dataclass(frozen=True, kw_only=True)
class ProfileKey(_Key):
    """Everything that must match for a stored profile to stand for a new measurement."""

    world_size: int
    """Ranks in the job: ZeRO partitions, and so memory, depend on it."""
    activation_checkpointing: bool = False
    """Measured with the model recomputing its activations in backward."""
    optimizer_offload: bool = False
    """Measured with the optimizer offloaded to the host (ZeRO stages 1-2)."""

    @property
    def levers(self) -> Levers:
        """``(activation_checkpointing, optimizer_offload)``, as a profile's `levers`."""
        return (self.activation_checkpointing, self.optimizer_offload)

    @staticmethod
    def _own(profile: Profile) -> dict[str, Any]:
        return {
            "world_size": profile.world_size,
            "activation_checkpointing": profile.activation_checkpointing,
            "optimizer_offload": profile.optimizer_offload,
        }


@dataclass(frozen=True, kw_only=True)
class LayerProfileKey(_Key):
    """Everything that must match for a stored layer profile to stand for a new measurement."""

    micro_batch_sizes: tuple[int, ...]
    """The sizes the layers were timed at: other sizes asked for are measured again."""
    measured_dtype: str = "float32"
    """The dtype the layers ran in (``measured_with.measured_dtype``): before they were cast to the job's,
    a half-precision job's layer profiles were timed in fp32, and such a stored one is measured again."""

    @staticmethod
    def _own(profile: LayerProfile) -> dict[str, Any]:
        return {
            "micro_batch_sizes": tuple(s.micro_batch_size for s in profile.layers[0].samples),
            "measured_dtype": str(profile.measured_with.get("measured_dtype", "float32")),
        }


@dataclass(frozen=True, kw_only=True)
class JobKey:
    """What a profiling job keys every profile with (the automatic mode's too, before it measures): `key`
    completes it for a device type, stage and memory levers; `holds` says whether a stored profile is one
    its cache lookup finds."""

    model_fingerprint: str
    emulations: Mapping[str, Emulation | None]
    """Every device type of the job: its emulation without drift (`ProfileKey.emulation`), or None."""
    world_size: int
    dtype: str
    sequence_length: int | None
    torch_version: str
    deepspeed_version: str
    ds_config_fingerprint: str
    settings: MeasureSettings | None = None
    """How much the job measures: a stored profile measured with less (`_measured_less`) is not held, as its
    cache lookup measures it again; None: any. Not in the keys."""

    @classmethod
    def of_job(
        cls,
        ds_config: Mapping[str, Any],
        optimizer_factory: Callable[[list], Any] | None,
        *,
        emulations: Mapping[str, Emulation | None],
        **job: Any,
    ) -> JobKey:
        """The key of a job profiling with `ds_config` and `optimizer_factory` on the device types of
        `emulations` (`job`: the other fields), under this process's torch and DeepSpeed."""
        import deepspeed
        import torch

        from poplar_ext.hardware.emulation import without_drift

        return cls(
            emulations={t: without_drift(e) for t, e in emulations.items()},
            torch_version=torch.__version__,
            deepspeed_version=deepspeed.__version__,
            ds_config_fingerprint=ds_config_fingerprint(ds_config, client_optimizer(optimizer_factory)),
            **job,
        )

    def _shared(self, device_type: str, zero_stage: int) -> dict[str, Any]:
        """What a profile and a layer profile of `device_type` at `zero_stage` are both keyed with."""
        job = {f.name: getattr(self, f.name) for f in dataclasses.fields(_Key) if hasattr(self, f.name)}
        return {**job, "device_type": device_type, "emulation": self.emulations[device_type], "zero_stage": zero_stage}

    def key(self, device_type: str, zero_stage: int, checkpointing: bool = False, offload: bool = False) -> ProfileKey:
        return ProfileKey(
            **self._shared(device_type, zero_stage),
            world_size=self.world_size,
            activation_checkpointing=checkpointing,
            optimizer_offload=offload,
        )

    def layer_key(self, device_type: str, zero_stage: int, micro_batch_sizes: tuple[int, ...]) -> LayerProfileKey:
        """A layer profile's key: its layers are timed alone, so the world size is not in it."""
        return LayerProfileKey(
            **self._shared(device_type, zero_stage), micro_batch_sizes=micro_batch_sizes, measured_dtype=self.dtype
        )

    def holds(self, profile: Profile | LayerProfile) -> bool:
        """Whether `profile` is one this job's cache lookup finds (`find_cached_profile` with `settings`;
        a layer profile's sizes and settings aside, as the whole model's sizes are). A job that does not know its
        sequence length (None: data without token ids, `poplar_ext.profiler.auto.sequence_length_of`) takes any.
        A profile this profiler did not measure (``modelled``, written by hand, or without the key's records) is
        the user's word, taken as given in the job's dtype: there is nothing in it to compare."""
        layers = isinstance(profile, LayerProfile)
        stored = LayerProfileKey.of_profile(profile) if layers else ProfileKey.of_profile(profile)
        if stored is None:
            return profile.model.dtype == self.dtype
        if profile.device_type not in self.emulations:
            return False
        if layers:
            wanted = self.layer_key(profile.device_type, profile.zero_stage, stored.micro_batch_sizes)
        else:
            wanted = self.key(profile.device_type, profile.zero_stage, *profile.levers)
        if self.sequence_length is None:
            wanted = dataclasses.replace(wanted, sequence_length=stored.sequence_length)
        return _reusable(profile, wanted, None if layers else self.settings)


def profiles_key(
    options: ProfileOptions, model_fingerprint: str, world_size: int, emulations: Mapping[str, Any]
) -> JobKey:
    """What `profile_with(options)` keys the profiles of the model with `model_fingerprint` with, on `world_size`
    ranks of the device types of `emulations` (`profile_layers` its layer profiles: `JobKey.layer_key`, the
    fingerprint `layers_fingerprint`'s); the automatic mode matches stored profiles by it too."""
    # Here, not at the top: the measurement imports torch, which a cache lookup does not need.
    from poplar_ext.profiler.measure import MeasureSettings, read_ds_config, training_dtype

    ds_config = read_ds_config(options.ds_config)
    return JobKey.of_job(
        ds_config,
        options.optimizer_factory,
        emulations=emulations,
        model_fingerprint=model_fingerprint,
        world_size=world_size,
        dtype=training_dtype(ds_config),
        sequence_length=options.sequence_length,
        settings=MeasureSettings.of(options),
    )


def writable_directory(directory: Path, *, rank: int, name: str = "cache_dir") -> None:
    """`directory` made, and a file written there, by rank 0 before anything is measured (collective):
    one that cannot be is a ValueError naming `name` on every rank, not rank 0's OSError after a stage."""

    def check() -> None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=directory).close()
        except OSError as exc:
            found = f"{directory} ({exc.strerror or exc})"
            raise ValueError(f"{name}: expected a directory rank 0 can write profiles into, found {found}") from None

    decided_by_rank0(check, rank=rank)


@dataclass
class WritableBeforeMeasuring:
    """`writable_directory`, called where something is first to be measured and written: a cache with nothing
    to measure is read from a directory rank 0 cannot write. Collective (every rank calls it at the same
    agreed point); checked once."""

    directory: Path
    rank: int
    name: str = "cache_dir"
    checked: bool = False

    def __call__(self) -> None:
        if not self.checked:
            writable_directory(self.directory, rank=self.rank, name=self.name)
            self.checked = True


def _load_profile(path: Path) -> Profile | None:
    data = read_json(path)
    # Not a profile: e.g. the cluster poplar-profile discovered.
    return None if is_cluster_or_plan(data) else profile_from_dict(data, source=str(path))


def _stored(directory: Path, *, layers: bool = False, stacklevel: int = 3) -> list[tuple[Path, Any]]:
    """Every profile (`layers`: layer profile) in `directory` (its ``layers/``), each with its path; a bad file's
    warning points `stacklevel` frames up: at the caller of the public lookup (3) or store (4, through `_store`)."""
    directory, load = (layer_profiles_dir(directory), load_layer_profile) if layers else (directory, _load_profile)
    found = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else ():
        try:
            loaded = load(path)
        except FormatError as exc:
            # Not fatal here: the profile is measured again and the bad file is named.
            kind = "layer profile" if layers else "profile"
            warnings.warn(f"profile cache: ignoring a file that is not a valid {kind}: {exc}", stacklevel=stacklevel)
            continue
        if loaded is not None:
            found.append((path, loaded))
    return found


def cached_on_rank0(
    rank: int,
    options: ProfileOptions,
    keys: Mapping[Hashable, Any],
    find: Callable,
    to_dict: Callable,
    *,
    on_miss: Callable[[Any, str], None] | None = None,
) -> dict[Any, dict[str, Any]]:
    """What `find` finds in ``options.cache_dir`` for each of `keys` (what -> key), as dicts: read by rank 0
    ({} on the other ranks, and with ``options.force``). `on_miss` hears, for each key not found where the
    cache holds a profile of its model, type and stage, why that one is not reused (`not_reused_because`)."""
    if rank != 0 or options.force:
        return {}
    found = {what: find(options.cache_dir, key) for what, key in keys.items()}
    stored_by_kind: dict[bool, list[tuple[Path, Any]]] = {}  # the directory read once for all misses of a kind
    for what, key in keys.items():
        if on_miss is None or found[what] is not None:
            continue
        layers = isinstance(key, LayerProfileKey)
        if layers not in stored_by_kind:
            stored_by_kind[layers] = _stored(Path(options.cache_dir), layers=layers)
        why = not_reused_because(options.cache_dir, key, stored=stored_by_kind[layers])
        if why is not None:
            on_miss(what, why)
    return {what: to_dict(profile) for what, profile in found.items() if profile is not None}


def not_reused_because(
    cache_dir: str | Path, key: ProfileKey | LayerProfileKey, *, stored: list[tuple[Path, Any]] | None = None
) -> str | None:
    """Why the stored profile of `key`'s model, device type, stage (and memory levers) closest to `key` is not
    reused: the key fields it differs in, or that it was measured with less; None where none is stored. A job
    measuring again at every start is most often a DeepSpeed config or version changed, and says which.
    `stored`: the cache's profiles of `key`'s kind with their paths, where the caller read them already."""
    layers = isinstance(key, LayerProfileKey)
    if stored is None:
        stored = _stored(Path(cache_dir), layers=layers, stacklevel=4)

    # A layer profile has no levers: its slot is its model, type and stage.
    wanted = (key.model_fingerprint, key.device_type, key.zero_stage, getattr(key, "levers", None))
    differences = []
    for path, profile in stored:
        if (
            profile.model.fingerprint,
            profile.device_type,
            profile.zero_stage,
            getattr(profile, "levers", None),
        ) != wanted:
            continue
        recorded = (LayerProfileKey if layers else ProfileKey).of_profile(profile)
        if recorded is None:
            differences.append((1, f"{path.name} was not measured by this profiler"))
            continue
        changed = [_changed(f.name, getattr(recorded, f.name), getattr(key, f.name)) for f in dataclasses.fields(key)]
        changed = [text for text in changed if text is not None]
        what = f"differs in {', '.join(changed)}" if changed else "was measured with less than asked"
        differences.append((len(changed), f"{path.name} {what}"))
    return min(differences)[1] if differences else None


def _changed(name: str, stored: Any, wanted: Any) -> str | None:
    """A key field that differs, with both values where they are short enough to read."""
    if stored == wanted:
        return None
    short = all(len(str(v)) <= 24 for v in (stored, wanted))
    return f"{name} ({stored} stored, {wanted} now)" if short else name


def find_cached_profile(
    cache_dir: str | Path, key: ProfileKey, *, settings: MeasureSettings | None = None
) -> Profile | None:
    """The stored profile whose key equals `key`, or None. With `settings`, one measured with less than they
    ask (`_measured_less`) is None too. One found among the profiles of `key`'s world size that another world
    size replaced (`parked_profiles_dir`) is moved back into `cache_dir`, where the search reads it (rank 0's
    lookup: the only writer)."""
    directory = Path(cache_dir)

    def reusable_in(folder: Path) -> tuple[Path, Profile] | None:
        return next(((path, p) for path, p in _stored(folder, stacklevel=4) if _reusable(p, key, settings)), None)

    found = reusable_in(directory)
    if found is not None:
        return found[1]
    parked = reusable_in(parked_profiles_dir(directory, key.world_size))
    if parked is None:
        return None
    path, profile = parked
    try:
        # Over a top-level profile of the same key and world size, if any (not reusable here: a dtype or
        # settings of another job), as a new measurement would be.
        store_profile(directory, profile)
        path.unlink()
    except OSError as exc:  # a read-only cache: the job still reuses it, from where it is
        warnings.warn(f"profile cache: reused {path} but could not move it back into {directory}: {exc}", stacklevel=2)
    return profile


def _reusable(
    profile: Profile | LayerProfile, key: ProfileKey | LayerProfileKey, settings: MeasureSettings | None
) -> bool:
    """Whether the cache reuses `profile` for `key`: its key is `key` and, with `settings`, it was not measured
    with less than they ask."""
    layers = isinstance(profile, LayerProfile)
    if (LayerProfileKey if layers else ProfileKey).of_profile(profile) != key:
        return False
    return settings is None or not (_fewer_micro_steps if layers else _measured_less)(profile, settings)


def _measured_less(profile: Profile, settings: MeasureSettings) -> bool:
    """Whether `profile` holds less than `settings` would measure: a probe a lower micro-batch limit stopped
    (its largest micro-batch is that limit, not what fits); fewer warm-up or timed micro-steps per size (or
    none recorded: more are asked for a steadier median, less of the first steps' cost); a sweep without a
    size they time up to its largest (`sweep_sizes` of theirs to the profile's largest), unless the profile
    records it ran out of memory there (memory not monotonic in the size: measuring again would miss it
    again). A profile measured with more is as good: it is reused."""
    probe = profile.measured_with.get("largest_micro_batch_probe")
    probe = probe if isinstance(probe, Mapping) else {}
    limited = probe.get("limited_by_micro_batch_size_limit") is True
    out_of_memory = probe.get("out_of_memory_in_sweep")
    ran_out = {b for b in out_of_memory if isinstance(b, int)} if isinstance(out_of_memory, list) else set()
    swept = {s.micro_batch_size for s in profile.samples} | ran_out
    unswept = not swept.issuperset(sweep_sizes(settings.micro_batch_sizes, profile.max_micro_batch_size))
    stopped = limited and profile.max_micro_batch_size < settings.micro_batch_size_limit
    return stopped or unswept or _fewer_micro_steps(profile, settings)


def _fewer_micro_steps(profile: Profile | LayerProfile, settings: MeasureSettings | ProfileOptions) -> bool:
    """Whether `profile` records fewer warm-up or timed micro-steps per size than `settings` ask, or none."""
    recorded = profile.measured_with
    return any(
        not isinstance(recorded.get(name), int) or recorded[name] < getattr(settings, name)
        for name in ("warmup_micro_steps", "repeats")
    )


def profile_file_name(profile: Profile | LayerProfile) -> str:
    """A readable file name, e.g. ``gpt-a1b2c3d4-A100-80GB-zero2.json`` (``-ckpt`` with activation
    checkpointing, ``-offload`` with optimizer offload; never parsed)."""
    levers = "".join(
        suffix
        for suffix, on in (("-ckpt", "activation_checkpointing"), ("-offload", "optimizer_offload"))
        if getattr(profile, on, False)
    )
    fingerprint = profile.model.fingerprint.split(":")[-1][:8]
    stem = f"{profile.model.name}-{fingerprint}-{profile.device_type}-zero{profile.zero_stage}{levers}"
    return re.sub(r"[^A-Za-z0-9._-]+", "_", stem) + ".json"


PARKED_PROFILES_DIR = "other-world-sizes"
"""Sub-directory of a profile cache: the profiles another world size's replaced (the search does not read them)."""


def parked_profiles_dir(cache_dir: str | Path, world_size: int) -> Path:
    """Where `store_profile` keeps the profiles of `world_size` ranks that another world size's replaced, so that
    an elastic job going from one size to another and back measures each size once (`find_cached_profile`)."""
    return Path(cache_dir) / PARKED_PROFILES_DIR / f"world-size-{world_size}"


def parked_profiles(cache_dir: str | Path, world_size: int) -> list[Profile]:
    """The profiles of `world_size` ranks kept in `parked_profiles_dir`: what a lookup on that many ranks moves
    back counts as reused, not measured (calibration checks it)."""
    return [profile for _, profile in _stored(parked_profiles_dir(cache_dir, world_size))]


def store_profile(cache_dir: str | Path, profile: Profile) -> Path:
    """Write `profile` atomically into `cache_dir` and return its path; a stored one with the same
    `Profile.key` and model (the search loads one per directory) is replaced, in its own file: kept in
    `parked_profiles_dir` where it was measured on another number of ranks."""

    def park(replaced: Profile, path: Path) -> None:
        if replaced.world_size != profile.world_size:
            write_text_atomic(path.read_text(), parked_profiles_dir(cache_dir, replaced.world_size) / path.name)

    return _store(cache_dir, profile, lambda p: (*p.key, p.model.fingerprint), save_profile, before_replacing=park)


def find_cached_layer_profile(
    cache_dir: str | Path, key: LayerProfileKey, *, settings: MeasureSettings | ProfileOptions | None = None
) -> LayerProfile | None:
    """The layer profile in ``cache_dir/layers/`` whose key equals `key`, or None; with `settings`, None too
    for one timed over fewer micro-steps than they ask (its sizes are in the key)."""
    return next((p for _, p in _stored(Path(cache_dir), layers=True) if _reusable(p, key, settings)), None)


def store_layer_profile(cache_dir: str | Path, profile: LayerProfile) -> Path:
    """Write `profile` atomically into ``cache_dir/layers/`` and return its path; a stored one of the same
    device type, stage and model (the search reads one) is replaced."""
    return _store(cache_dir, profile, lambda p: (p.device_type, p.zero_stage, p.model.fingerprint), save_layer_profile)


def _store(
    cache_dir: str | Path,
    profile: Any,
    key: Callable[[Any], tuple],
    save: Callable[[Any, Path], None],
    before_replacing: Callable[[Any, Path], None] | None = None,
) -> Path:
    """`profile` written over the stored one of the same `key` (given first to `before_replacing`), else into a
    new file."""
    layers = isinstance(profile, LayerProfile)
    stored = _stored(Path(cache_dir), layers=layers, stacklevel=4)
    target, replaced = next(((path, s) for path, s in stored if key(s) == key(profile)), (None, None))
    if target is None:
        target = (layer_profiles_dir(cache_dir) if layers else Path(cache_dir)) / profile_file_name(profile)
    elif before_replacing is not None:
        before_replacing(replaced, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    save(profile, target)
    return target
