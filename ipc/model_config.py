"""Reading, checking and normalizing ``config.pbtxt`` the way Triton does (docs/triton-compat.md §3)."""
from __future__ import annotations

import json
import os

from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as mc

from shmserve.ipc import backend_catalog, model_files
from shmserve.ipc.backend_catalog import BackendCatalog, BackendNotFound

ModelConfig = mc.ModelConfig

class ConfigError(Exception):
    """A model configuration that cannot be served; the message names the problem."""


class ConfigMissing(ConfigError):
    """No config file at all (auto-complete may build one); a file that fails to parse is not this."""


def read_config(model_dir: str, name: str, config_name: str | None = None) -> mc.ModelConfig:
    filename = os.path.join("configs", f"{config_name}.pbtxt") if config_name else "config.pbtxt"
    path = os.path.join(model_dir, filename)
    if config_name and not os.path.exists(path):
        path = os.path.join(model_dir, "config.pbtxt")
    try:
        # never open() it blindly: a FIFO would block the scheduler for ever (ipc/model_files.py)
        text = model_files.read_bytes(path, model_files.CONFIG_MAX_BYTES).decode("utf-8")
    except FileNotFoundError:
        raise ConfigMissing(f"model configuration is not provided: {path} does not exist") from None
    except OSError as e:        # Triton's words for a config it cannot read
        raise ConfigError(f"failed to open text file for read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"failed to parse {path}: it is not UTF-8 text ({e.reason} at byte "
                          f"{e.start})") from None
    cfg = mc.ModelConfig()
    try:
        text_format.Parse(text, cfg)
    except text_format.ParseError as e:
        raise ConfigError(f"failed to parse {path}: {e}") from None
    return cfg


def config_from_json(text: str) -> mc.ModelConfig:
    cfg = mc.ModelConfig()
    try:
        json_format.Parse(text, cfg)
    except json_format.ParseError as e:
        raise ConfigError(f"failed to parse model configuration JSON: {e}") from None
    return cfg


def _check_tensors(cfg: mc.ModelConfig, kind: str, tensors) -> None:
    seen = set()
    for t in tensors:
        if not t.name:
            raise ConfigError(f"model '{cfg.name}' has an {kind} without a name")
        if t.name in seen:
            raise ConfigError(f"model '{cfg.name}' declares {kind} '{t.name}' more than once")
        seen.add(t.name)
        if t.data_type == mc.TYPE_INVALID:
            raise ConfigError(f"{kind} '{t.name}' of model '{cfg.name}' must specify a valid data_type")
        if len(t.dims) == 0 and not t.HasField("reshape"):
            raise ConfigError(f"{kind} '{t.name}' of model '{cfg.name}' must specify dims")
        for d in t.dims:
            if d < -1 or d == 0:
                raise ConfigError(f"{kind} '{t.name}' of model '{cfg.name}' has invalid dim {d} "
                                  f"(dims must be positive or -1)")
        if t.HasField("reshape") and -1 not in t.dims and -1 not in t.reshape.shape:
            n = 1
            for d in t.dims:
                n *= d
            m = 1
            for d in t.reshape.shape:
                m *= d
            if n != m:
                raise ConfigError(f"{kind} '{t.name}' of model '{cfg.name}' has reshape "
                                  f"{list(t.reshape.shape)} with a different element count than "
                                  f"dims {list(t.dims)}")


# A bound Triton does not set but a server must: each instance is a process. Past it a config is
# refused with the limit named. (Priority levels need none: a level's queue exists only while
# requests wait at it, so Triton's whole uint64 range is taken.)
MAX_INSTANCES_PER_MODEL = 128


def _check_file_name(name: str, what: str, value: str) -> None:
    """A file a config names lives in the model's own directory: a plain name, never a path, so
    that a load request cannot make a worker import or read any file of the host."""
    if value in (".", "..") or "/" in value or "\\" in value or "\0" in value:
        raise ConfigError(f"model '{name}': {what} '{value}' must be a file name inside the model "
                          f"directory, not a path")


def _check_dynamic_batching(cfg: mc.ModelConfig) -> None:
    db, name, mbs = cfg.dynamic_batching, cfg.name, cfg.max_batch_size
    for p in db.preferred_batch_size:
        if p <= 0 or (mbs > 0 and p > mbs):
            raise ConfigError(f"model '{name}': dynamic_batching preferred_batch_size {p} must be "
                              f"between 1 and max_batch_size ({mbs})")
    if not db.preferred_batch_size and mbs > 0:
        db.preferred_batch_size.append(mbs)
    levels = db.priority_levels
    if levels and not 1 <= db.default_priority_level <= levels:
        raise ConfigError(f"model '{name}': dynamic_batching default_priority_level must be in "
                          f"[1, {levels}] when priority_levels is {levels}")
    for level in db.priority_queue_policy:
        if not 1 <= level <= levels:
            raise ConfigError(f"model '{name}': dynamic_batching priority_queue_policy has level "
                              f"{level}, outside [1, priority_levels={levels}]")


def _normalize_sequence_batching(cfg: mc.ModelConfig) -> None:
    """Triton's defaults and what the scheduler relies on; the controls and the implicit state
    are checked by the worker, which builds them (workers/sequence.py), when it loads."""
    sb, name, mbs = cfg.sequence_batching, cfg.name, cfg.max_batch_size
    if not sb.max_sequence_idle_microseconds:
        sb.max_sequence_idle_microseconds = 1_000_000
    if not sb.HasField("oldest") and not sb.HasField("direct"):
        sb.direct.SetInParent()
    if sb.HasField("oldest"):
        o = sb.oldest
        if o.max_candidate_sequences <= 0:
            raise ConfigError(f"model '{name}': sequence_batching oldest "
                              f"max_candidate_sequences must be > 0")
        for p in o.preferred_batch_size:
            if p <= 0 or p > max(1, mbs):
                raise ConfigError(f"model '{name}': sequence_batching oldest "
                                  f"preferred_batch_size {p} must be between 1 and "
                                  f"max_batch_size ({max(1, mbs)})")
    elif not 0.0 <= sb.direct.minimum_slot_utilization <= 1.0:
        raise ConfigError(f"model '{name}': sequence_batching direct minimum_slot_utilization "
                          f"must be between 0 and 1")
    for state in sb.state:
        for init in state.initial_state:
            if init.HasField("data_file"):
                _check_file_name(name, f"state '{state.input_name}' initial_state "
                                       f"'{init.name}' data_file", init.data_file)


_catalog: BackendCatalog | None = None


def _default_catalog() -> BackendCatalog:
    global _catalog
    if _catalog is None:
        _catalog = BackendCatalog()
    return _catalog


def normalize(cfg: mc.ModelConfig, name: str, gpu_count: int = 0,
              backends: BackendCatalog | None = None) -> mc.ModelConfig:
    """Check a config and fill the defaults Triton fills (docs/triton-compat.md §3.3); raises
    ConfigError. ``backends``: where a config's backend is looked up (default: the built-in,
    shipped and installed ones)."""
    if cfg.name and cfg.name != name:
        raise ConfigError(f"model name '{cfg.name}' in config.pbtxt does not match the directory "
                          f"name '{name}'")
    cfg.name = name
    if cfg.platform == "ensemble":
        return _normalize_ensemble(cfg, name)
    if not cfg.backend:
        if cfg.platform in backend_catalog.PLATFORM_TO_BACKEND:
            cfg.backend = backend_catalog.PLATFORM_TO_BACKEND[cfg.platform]
        elif cfg.platform:      # Triton's words, then the ones that exist
            raise ConfigError(f"unexpected platform type '{cfg.platform}' for {name} (supported "
                              f"platforms: {', '.join(backend_catalog.PLATFORMS)})")
        else:
            raise ConfigError(f"model '{name}': config must set 'backend' (python, onnxruntime) "
                              f"or 'platform'")
    try:
        backend = (backends or _default_catalog()).find(cfg.backend)
    except BackendNotFound as e:
        raise ConfigError(f"model '{name}': {e}") from None
    if backend.kind == "python-based":      # Triton reports it so
        cfg.runtime = backend_catalog.PYTHON_BASED_FILE
    if not cfg.platform:
        cfg.platform = backend.platform
    if not cfg.default_model_filename:
        cfg.default_model_filename = backend.default_filename
    _check_file_name(name, "default_model_filename", cfg.default_model_filename)
    for w in cfg.model_warmup:
        for input_name, spec in w.inputs.items():
            if spec.input_data_file:
                _check_file_name(name, f"model_warmup '{w.name}' input '{input_name}' "
                                       f"input_data_file", spec.input_data_file)
    _check_io_and_versions(cfg)
    if cfg.HasField("dynamic_batching"):
        _check_dynamic_batching(cfg)
    if cfg.HasField("sequence_batching"):
        _normalize_sequence_batching(cfg)
    if not cfg.instance_group:
        cfg.instance_group.add()
    for i, group in enumerate(cfg.instance_group):
        if not group.name:
            group.name = f"{name}_{i}"
        if group.kind == mc.ModelInstanceGroup.KIND_AUTO:
            # a TensorRT engine runs only on a GPU: without one its load fails with the reason
            gpu = cfg.backend == "tensorrt" or (gpu_count and cfg.backend == "onnxruntime")
            group.kind = mc.ModelInstanceGroup.KIND_GPU if gpu else mc.ModelInstanceGroup.KIND_CPU
        if group.kind == mc.ModelInstanceGroup.KIND_GPU and not group.gpus:
            group.gpus.extend(range(gpu_count))
        if group.count == 0:
            group.count = 1
        if group.count < 0:
            raise ConfigError(f"instance_group '{group.name}' of model '{name}' has a negative count")
    total = instance_count(cfg)
    if total > MAX_INSTANCES_PER_MODEL:
        raise ConfigError(f"model '{name}': instance_group asks for {total} instances, more than "
                          f"the limit of {MAX_INSTANCES_PER_MODEL} (each is a process)")
    cfg.model_transaction_policy.decoupled = cfg.model_transaction_policy.decoupled
    if cfg.model_transaction_policy.decoupled and not backend.decoupled:
        raise ConfigError(f"model '{name}': the {cfg.backend} backend cannot serve a decoupled "
                          f"model (model_transaction_policy {{ decoupled: true }}); the "
                          f"{', '.join(backend_catalog.DECOUPLED_BUILT_IN)} backends and the "
                          f"python-based ones can")
    _check_response_cache(cfg)
    if not cfg.optimization.HasField("input_pinned_memory"):
        cfg.optimization.input_pinned_memory.enable = True
    if not cfg.optimization.HasField("output_pinned_memory"):
        cfg.optimization.output_pinned_memory.enable = True
    return cfg


def instance_count(cfg: mc.ModelConfig) -> int:
    """Worker processes one version of the model runs: a KIND_GPU group's count is per GPU."""
    return sum(g.count * (max(1, len(g.gpus)) if g.kind == mc.ModelInstanceGroup.KIND_GPU else 1)
               for g in cfg.instance_group)


def check_process_count(cfg: mc.ModelConfig, versions: int) -> None:
    """Each version runs its own instances, so the bound holds for all the versions a load
    starts together (``version_policy: { all: {} }`` over 1,000 version directories would
    otherwise start 1,000 processes per instance)."""
    total = instance_count(cfg) * versions
    if versions > 1 and total > MAX_INSTANCES_PER_MODEL:
        raise ConfigError(f"model '{cfg.name}': version_policy selects {versions} versions of "
                          f"{instance_count(cfg)} instance(s) each (instance_group), {total} "
                          f"worker processes, more than the limit of {MAX_INSTANCES_PER_MODEL}")


def _check_io_and_versions(cfg: mc.ModelConfig) -> None:
    """What every model's config needs, ensembles' too: tensors, batch size, version policy."""
    if cfg.max_batch_size < 0:
        raise ConfigError(f"model '{cfg.name}': max_batch_size must be >= 0")
    _check_tensors(cfg, "input", cfg.input)
    _check_tensors(cfg, "output", cfg.output)
    if not cfg.HasField("version_policy"):
        cfg.version_policy.latest.num_versions = 1
    elif cfg.version_policy.HasField("latest") and cfg.version_policy.latest.num_versions == 0:
        cfg.version_policy.latest.num_versions = 1


def _normalize_ensemble(cfg: mc.ModelConfig, name: str) -> mc.ModelConfig:
    """An ensemble runs no code of its own: no backend, no instances, no batcher (its steps
    are checked by engine/ensemble/plan.py when it loads)."""
    if cfg.backend:
        raise ConfigError(f"ensemble '{name}' must not set a backend (it has platform "
                          f"'ensemble'; its composing models have backends)")
    _check_io_and_versions(cfg)
    cfg.model_transaction_policy.decoupled = cfg.model_transaction_policy.decoupled
    _check_response_cache(cfg)
    return cfg


def _check_response_cache(cfg: mc.ModelConfig) -> None:
    """The response cache keeps one answer per request: a decoupled model gives any number
    (Triton's words; it refuses the load, with or without a server-side cache)."""
    if cfg.response_cache.enable and cfg.model_transaction_policy.decoupled:
        raise ConfigError(f"Response Cache does not currently support model '{cfg.name}' with "
                          f"'decoupled' transaction policy")


def select_versions(cfg: mc.ModelConfig, available: list[int]) -> tuple[list[int], list[int]]:
    """Versions the policy serves, and versions it asks for that do not exist."""
    available = sorted(available)
    policy = cfg.version_policy
    if policy.HasField("all"):
        return available, []
    if policy.HasField("specific"):
        wanted = sorted(set(policy.specific.versions))
        return [v for v in wanted if v in available], [v for v in wanted if v not in available]
    n = policy.latest.num_versions or 1
    return available[-n:], []


def _int64_to_numbers(msg, data: dict) -> None:
    """protobuf JSON prints int64 as strings; Triton prints them as numbers (docs/triton-compat.md §1.5)."""
    for field in msg.DESCRIPTOR.fields:
        key = field.name
        if key not in data:
            continue
        value = data[key]
        if field.type == field.TYPE_MESSAGE:
            if field.message_type.GetOptions().map_entry:
                vfield = field.message_type.fields_by_name["value"]
                int_keys = field.message_type.fields_by_name["key"].type != field.TYPE_STRING
                if vfield.type == vfield.TYPE_MESSAGE:
                    sub = getattr(msg, key)
                    for k, v in value.items():
                        _int64_to_numbers(sub[int(k) if int_keys else k], v)
            elif field.is_repeated:
                for sub_msg, sub_data in zip(getattr(msg, key), value):
                    _int64_to_numbers(sub_msg, sub_data)
            else:
                _int64_to_numbers(getattr(msg, key), value)
        elif field.type in (field.TYPE_INT64, field.TYPE_UINT64, field.TYPE_SINT64,
                            field.TYPE_FIXED64, field.TYPE_SFIXED64):
            data[key] = [int(v) for v in value] if isinstance(value, list) else int(value)


def config_to_dict(cfg: mc.ModelConfig) -> dict:
    data = json_format.MessageToDict(cfg, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)
    _int64_to_numbers(cfg, data)
    return data


def config_to_json(cfg: mc.ModelConfig) -> str:
    return json.dumps(config_to_dict(cfg), separators=(",", ":"))
