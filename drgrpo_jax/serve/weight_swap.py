"""The served weights and their hot swap: the generation the service samples with now (`ServedWeights.current`),
the full model an adapter merges into (`base`), and the pushes that replace them, from a folder or a shared-memory
segment, one at a time. What a generation is, how it loads and the checks it passes: weights.py.

A push replaces `current` whole, in one assignment, after every check: a batch reads it once when it starts (and,
with --inflight-updates, at its phase boundaries), so it never sees half an update, and a refused push leaves the
served weights as they were. The prefix cache keeps the blocks of one generation, known by identity, so the first
batch on a new `current` drops the old one's (`PrefixCache.take`)."""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

from jax.sharding import Mesh

from drgrpo_jax.config.serve import ServeConfig
from drgrpo_jax.errors import InvalidWeights
from drgrpo_jax.models.lora import is_adapter_folder
from drgrpo_jax.named_tensors import parse_index, read_segment
from drgrpo_jax.serve.weights import (
    Weights,
    check_compatible,
    check_newer,
    load_served,
    load_weights,
    weights_from_tensors,
    with_adapter,
)
from drgrpo_jax.weight_folders import local_folder

log = logging.getLogger("drgrpo_jax.serve")  # one logger name for the whole service
__all__ = ["ServedWeights"]


class ServedWeights:
    """The service's current weights, the base under them, and the lock that makes each push load, check and swap
    in alone (its version is checked against the one it replaces)."""

    def __init__(self, config: ServeConfig, mesh: Mesh | None):
        self.dtype, self.mesh = config.dtype, mesh
        # `base`: the last full model loaded; `current`: what is served (the base, or it with an adapter merged).
        self.base, self.current = load_served(config.model, config.dtype, config.weight_version, mesh)
        self._lock = threading.Lock()

    def load_folder(self, path: str, version: str, *, shown_path: str | None = None,
                    allow_rollback: bool = False) -> Weights:
        """Loads, checks and swaps in new weights; on any error the served weights stay as they were.

        `path`: a model folder (the new base), or a PEFT LoRA adapter folder, merged into the current base.
        Raises InvalidWeights with a message fit for the client: what failed to load is logged here only.
        `shown_path`: the path as the client gave it (reported by /get_model_info). `allow_rollback`: an
        older integer version is accepted (a trainer resuming from a checkpoint).
        """
        with self._lock:
            if not allow_rollback:
                check_newer(self.current.version, version)
            old, shown = self.current, shown_path or path
            try:
                with local_folder(path) as folder:  # a gs:// folder is copied to local disk first
                    if is_adapter_folder(folder):
                        new, base = self._adapter_weights(folder, version, shown), self.base
                    else:
                        new = base = self._model_weights(folder, version)
            except InvalidWeights:
                raise
            except Exception as error:  # noqa: BLE001 - a folder that cannot be fetched or read
                log.warning("weight update from %s refused: %s: %s", path, type(error).__name__, error)
                raise InvalidWeights("model_path: not a valid model folder") from None
            # Keep the old graphdef: it is the static key of the compiled programs (no recompiles).
            self.base = dataclasses.replace(base, graphdef=old.graphdef, config=old.config)
            self.current = dataclasses.replace(new, graphdef=old.graphdef, config=old.config, path=shown)
            log.info("weights %s -> %s from %s%s", old.version, new.version, path, " (adapter)" if new.adapter else "")
            return self.current

    def load_segment(self, segment: str, index: list[dict[str, Any]], version: str, *,
                     allow_rollback: bool = False) -> Weights:
        """Swaps in a whole model read from shared-memory segment `segment` (`tensor_segment`, written by the
        trainer that started this service); like `load_folder`, the served weights stay on any error.

        The writer may delete the segment once this returns: the new arrays are copies or (XLA on CPU may skip
        the copy) hold the pages mapped, and a segment is never written again. Raises InvalidWeights naming the
        tensor or field at fault.
        """
        with self._lock:
            if not allow_rollback:
                check_newer(self.current.version, version)
            old = self.current
            try:
                tensors = read_segment(segment, parse_index(index))
                new = weights_from_tensors(old, tensors, self.dtype, version, f"shm:{segment}")
                del tensors  # the views unmap with it
                check_compatible(old, new)
            except FileNotFoundError:
                raise InvalidWeights("segment: no such shared-memory segment") from None
            except ValueError as error:  # names, shapes, dtypes: nothing about the machine
                raise InvalidWeights(str(error)) from None
            except OSError as error:
                log.warning("weight update from segment %s refused: %s", segment, error)
                raise InvalidWeights("segment: cannot be read") from None
            self.base = self.current = new
            log.info("weights %s -> %s from shared memory", old.version, new.version)
            return new

    def _model_weights(self, folder: str, version: str) -> Weights:
        """A full model folder, checked against the served model; InvalidWeights otherwise."""
        try:
            new = load_weights(folder, self.dtype, version, self.mesh)
        except Exception as error:  # noqa: BLE001 - missing, unreadable, corrupt: one answer for all of them
            log.warning("weight update from %s refused: %s: %s", folder, type(error).__name__, error)
            raise InvalidWeights("model_path: not a valid model folder") from None
        try:
            check_compatible(self.current, new)
        except ValueError as error:  # names what differs from the served model, nothing about the disk
            raise InvalidWeights(f"model_path: {error}") from None
        return new

    def _adapter_weights(self, folder: str, version: str, shown_path: str) -> Weights:
        """The base with the adapter in `folder` merged; InvalidWeights naming what does not fit."""
        try:
            return with_adapter(self.base, folder, version, shown_path)
        except (ValueError, KeyError) as error:  # tensor names and shapes, nothing about the disk
            raise InvalidWeights(f"model_path: {error}") from None
        except Exception as error:  # noqa: BLE001 - unreadable or corrupt files
            log.warning("adapter update from %s refused: %s: %s", folder, type(error).__name__, error)
            raise InvalidWeights("model_path: not a valid adapter folder") from None
