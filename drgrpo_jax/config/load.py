"""YAML + dotted overrides -> a validated Config: OmegaConf's typed merge, unknown keys and wrong types as
one-line ConfigErrors; the command line of every entry point; the local paths a run reads."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
from collections.abc import Callable

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    OmegaConfBaseException,
)

from drgrpo_jax.config.rules import validate
from drgrpo_jax.config.schema import Config, LoraConfig, MoeConfig
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.hub_ids import TOKENIZER_FILES, hub_id, local_model
from drgrpo_jax.models.hf_io import SafetensorsIndex

__all__ = [
    "check_paths", "config_from_argv", "describe_config", "dump_config", "load_config", "read_config_file",
    "resolve_model_path", "translate_error"
]

# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------



# Keys that are Python keywords: (section, key as written in YAML and overrides) -> the dataclass field.
_KEY_ALIASES = {("rollout", "async"): "async_"}


def _to_fields(update: DictConfig) -> None:
    """Renames aliased keys (rollout.async) to their fields, in place, before the typed merge."""
    for (section, key), field in _KEY_ALIASES.items():
        part = update.get(section) if isinstance(update, DictConfig) else None
        if isinstance(part, DictConfig) and key in part:
            part[field] = part[key]
            del part[key]


def _key_name(field: str) -> str:
    """The key a field is written as (its alias, when it has one)."""
    return {f: key for (_, key), f in _KEY_ALIASES.items()}.get(field, field)


# Section name -> dataclass (annotations are strings under `from __future__ import annotations`).
_FIELD_TYPES: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)}  # type: ignore[misc]
_FIELD_TYPES["model.lora"] = LoraConfig  # sections inside a section
_FIELD_TYPES["model.moe"] = MoeConfig


def _section_fields(path: str) -> list[str]:
    """Field names of the section at `path` ('' = the sections themselves); [] when it is no section."""
    cls = Config if not path else _FIELD_TYPES.get(path)
    return [_key_name(f.name) for f in dataclasses.fields(cls)] if cls is not None else []


def _unknown_key_error(full_key: str, where: str, section_fields: Callable[[str], list[str]]) -> ConfigError:
    """An unknown-key error with a did-you-mean drawn from the section's real fields."""
    parent, _, leaf = full_key.rpartition(".")
    candidates = section_fields(parent)
    close = difflib.get_close_matches(leaf, candidates, n=1, cutoff=0.6)
    prefix = f"{parent}." if parent else ""
    if close:
        hint = f"; did you mean {prefix}{close[0]}?"
    else:
        hint = f"; known keys: {', '.join(candidates)}" if candidates else ""
    return ConfigError(full_key, f"unknown key{where}{hint}")


def translate_error(error: OmegaConfBaseException, where: str,
                    section_fields: Callable[[str], list[str]] = _section_fields) -> ConfigError:
    """Turns an OmegaConf error into a one-line ConfigError naming the dotted key; `section_fields`: a section's
    keys by its dotted path (the did-you-mean of an unknown key)."""
    full_key = str(getattr(error, "full_key", "") or "") or "config"
    message = str(getattr(error, "msg", "") or error).splitlines()[0]
    if isinstance(error, (ConfigKeyError, ConfigAttributeError)):  # OmegaConf's two types for an unknown key
        return _unknown_key_error(full_key, where, section_fields)
    return ConfigError(full_key, f"{message}{where}")


def _merge(base: DictConfig, update: DictConfig, where: str) -> DictConfig:
    """Typed merge of `update` into `base`; any failure becomes a ConfigError."""
    _to_fields(update)
    raw = OmegaConf.to_container(update, resolve=False)  # interpolations stay unresolved
    assert isinstance(raw, dict)
    for section, value in raw.items():
        if section in _FIELD_TYPES and value is None:  # an empty YAML section ("train:") sets nothing
            del update[section]
        elif section in _FIELD_TYPES and not isinstance(value, dict):
            raise ConfigError(str(section), f"must be a mapping of fields, got {value!r}{where}")
    try:
        merged = OmegaConf.merge(base, update)
    except OmegaConfBaseException as error:
        raise translate_error(error, where) from None
    assert isinstance(merged, DictConfig)
    return merged


def _parse_overrides(overrides: list[str]) -> DictConfig:
    """Dotted `key=value` overrides as a DictConfig (values parsed as YAML, like the file)."""
    for override in overrides:
        key, equals, value = override.partition("=")
        if not equals or not key.strip():
            raise ConfigError(override, "an override must look like section.key=value")
        try:
            yaml.safe_load(value)
        except yaml.YAMLError as error:  # the value is read as YAML, as in the file
            problem = getattr(error, "problem", None) or type(error).__name__
            raise ConfigError(key.strip(), f"{value!r} is not a YAML value ({problem}); quote it as a string: "
                                           f"{key.strip()}='\"{value}\"'") from None
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as error:
        raise translate_error(error, " (command line)") from None


def load_config(path: str | os.PathLike[str] | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Loads YAML `path` (None = defaults), applies dotted overrides, validates; raises ConfigError."""
    merged = OmegaConf.structured(Config)
    if path is not None:
        merged = _merge(merged, read_config_file(path), f" in {os.fspath(path)}")
    merged = _merge(merged, _parse_overrides(list(overrides)), " (command line)")
    try:
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:  # e.g. a missing value or a bad interpolation
        raise translate_error(error, "") from None
    assert isinstance(config, Config)
    validate(config)
    return config


def read_config_file(path: str | os.PathLike[str]) -> DictConfig:
    """The YAML mapping at `path`, untyped; a missing, unreadable or non-mapping file is a ConfigError on --config."""
    if not os.path.isfile(path):
        raise ConfigError("--config", f"no such file {os.fspath(path)!r}")
    try:
        loaded = OmegaConf.load(os.fspath(path))  # load() reads any non-str, non-Path argument as a file object
    except (yaml.YAMLError, OmegaConfBaseException, OSError, UnicodeDecodeError) as error:
        raise ConfigError("--config", f"cannot parse {os.fspath(path)!r}: {error}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError("--config", f"{os.fspath(path)!r} must hold a mapping of sections")
    return loaded


def dump_config(config: Config) -> str:
    """The resolved config as YAML (loads back to an equal Config); aliased fields under their keys."""
    tree = OmegaConf.to_container(OmegaConf.structured(config))
    assert isinstance(tree, dict)
    for section in {section for section, _ in _KEY_ALIASES}:
        tree[section] = {_key_name(k): v for k, v in tree[section].items()}
    return OmegaConf.to_yaml(OmegaConf.create(tree))


def describe_config() -> str:
    """Every section and field with its default and description (for `--help`)."""
    lines = ["Config sections (override any field as section.key=value):"]
    for section in dataclasses.fields(Config):
        cls = _FIELD_TYPES[section.name]
        lines.append(f"\n{section.name}: {(cls.__doc__ or '').strip()}")
        lines += _describe_fields(section.name, cls)
    return "\n".join(lines)


def _describe_fields(prefix: str, cls: type) -> list[str]:
    """`prefix.field = default  # help` for each field of a section, nested sections expanded."""
    lines, defaults = [], cls()
    for field in dataclasses.fields(cls):
        default = getattr(defaults, field.name)
        if dataclasses.is_dataclass(default):
            lines.append(f"  {prefix}.{field.name} = (section)  # {field.metadata.get('help', '')}:")
            lines += _describe_fields(f"{prefix}.{field.name}", type(default))
            continue
        shown = "null" if default is None else repr(default) if isinstance(default, str) else default
        lines.append(f"  {prefix}.{_key_name(field.name)} = {shown}  # {field.metadata.get('help', '')}")
    return lines



def resolve_model_path(spec: str, key: str = "model.path") -> str:
    """A local HF folder or .gguf file as given, a Hub id `org/name[@revision]` -> its snapshot folder in the HF
    cache (downloaded when online), or `pkg:NAME` -> the one .gguf inside installed package NAME (`local_model`,
    which every command that takes a model resolves through)."""
    path = local_model(spec, key)
    if os.path.isdir(path):
        try:  # each file's header only: a truncated or foreign file is a bad path, found before anything loads
            SafetensorsIndex(path)
        except (OSError, ValueError) as error:
            raise ConfigError(key, str(error).removeprefix("path: ")) from None
        return path
    if path.endswith(".gguf") and os.path.isfile(path):
        return path
    raise ConfigError(key, f"no such folder {path!r} (a local Hugging Face model folder, a .gguf file, a Hub id "
                           "org/name[@revision] or pkg:PACKAGE)")


def check_paths(config: Config) -> None:
    """Raises ConfigError when a path the run reads (model, tokenizer, data) is neither local nor a Hub id that
    resolves (models and tokenizers are fetched into the HF cache here; datasets when they are loaded)."""
    c = config
    resolve_model_path(c.model.path)
    if c.model.tokenizer_path:
        tokenizer = local_model(c.model.tokenizer_path, "model.tokenizer_path", TOKENIZER_FILES)
        if not os.path.isdir(tokenizer):
            raise ConfigError("model.tokenizer_path", f"no such folder {tokenizer!r} (a local tokenizer folder or a "
                                                      "Hub id org/name[@revision])")
    if c.data.source != "reasoning_gym":
        for key, path in [("data.path", c.data.path), ("data.eval_path", c.data.eval_path)]:
            if path and not os.path.exists(path) and hub_id(path) is None:
                raise ConfigError(key, f"no such file or folder {path!r} (nor a Hub dataset id org/name[@revision])")


def config_from_argv(argv: list[str] | None = None, prog: str = "drgrpo_jax") -> Config:
    """`--config PATH [section.key=value ...]` -> Config.

    `--help` lists the sections; a bad config exits 2 in one line.
    """
    parser = argparse.ArgumentParser(
        prog=prog, epilog=describe_config(), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=None, help="YAML file of the run (omit for the defaults)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=3 mesh.data=2")
    args = parser.parse_args(argv)
    try:
        return load_config(args.config, args.overrides)
    except ConfigError as error:
        parser.exit(2, f"{prog}: config error: {error}\n")
