"""Distributed training at the edge: the only module of looplm that imports ``torch.distributed``.

Launch with ``torchrun --nproc_per_node=N -m looplm train ...``; ``train.distributed``: DDP or FSDP2
(``fully_shard`` on every block and the root). ``train.batch_size`` is the global batch: every rank cuts the same
batch (a function of (seed, step, micro)), keeps its own rows and draws the same depth, so the graph is identical
on all ranks (no ``find_unused_parameters``) and the averaged gradient equals the single-process one.
Checkpoints, consolidated (rank 0) or sharded (DCP), resume under any world size.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: rank, world size and its device."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def resolve_device(name: str, field: str = "train.device") -> torch.device:
    """``cpu``, ``cuda``, ``cuda:N`` or ``auto`` as a torch device; ValueError naming ``field`` otherwise."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not (name == "cpu" or name == "cuda" or name.startswith("cuda:")):
        raise ValueError(f"{field}: got {name!r}; allowed: 'cpu', 'cuda', 'cuda:N', 'auto'")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"{field}={name} but no CUDA device is available; use cpu or auto")
    return torch.device(name)


def init_distributed(device: torch.device) -> DistEnv:
    """Join the process group (nccl on ``cuda:LOCAL_RANK``, else gloo) when ``WORLD_SIZE`` > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistEnv(device=device)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return DistEnv(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device)


def shutdown(env: DistEnv) -> None:
    if env.enabled and dist.is_initialized():
        dist.destroy_process_group()


def local_rows(batch_size: int, env: DistEnv) -> slice:
    """This rank's rows of a global batch (ValueError unless divisible by the world size)."""
    if batch_size % env.world_size:
        raise ValueError(f"train.batch_size={batch_size} must be divisible by the world size {env.world_size}")
    per = batch_size // env.world_size
    return slice(env.rank * per, (env.rank + 1) * per)


def wrap_model(model: nn.Module, mode: str, env: DistEnv) -> nn.Module:
    """DDP, or FSDP2 in place on every block and the root (parameters become DTensors); unchanged alone."""
    if not env.enabled:
        return model
    if mode == "ddp":
        ids = [env.device.index] if env.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        from looplm.model.layers import Block

        for module in model.modules():
            if isinstance(module, Block):
                fully_shard(module)
        fully_shard(model)
        return model
    raise ValueError(f"train.distributed: unknown {mode!r}; allowed: 'ddp', 'fsdp'")


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under a DDP wrapper (FSDP2 modifies modules in place)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


@contextlib.contextmanager
def unsharded(model: nn.Module) -> Iterator[None]:
    """FSDP2: gather the root module's own parameters (embedding, readout, norms) for calls that bypass its
    ``forward`` (``model.read(model.loop(...))``); the blocks gather theirs in their own forward hooks.
    A no-op for any other module."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


def mean_across_ranks(value: float, env: DistEnv) -> float:
    """Average a Python float over ranks (float64 sum; for logging)."""
    if not env.enabled:
        return value
    return float(all_reduce_sum(torch.tensor([value], dtype=torch.float64), env)) / env.world_size


def all_reduce_sum(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum of a tensor over ranks (a copy; the input is unchanged). Identity without distribution."""
    if not env.enabled:
        return t
    out = t.detach().clone().to(env.device)
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out.to(t.device, t.dtype)


def _state_dict_options(mode: str, env: DistEnv, *, saving: bool, strict: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    sharded = env.enabled and mode == "fsdp"
    return StateDictOptions(full_state_dict=saving or sharded, cpu_offload=saving and sharded, strict=strict)


def full_state(model: nn.Module, opt: torch.optim.Optimizer, mode: str, env: DistEnv) -> tuple[dict, dict]:
    """Consolidated model and optimizer state dicts keyed by FQNs without wrapper prefixes (complete on rank 0;
    collective under FSDP)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    opts = _state_dict_options(mode, env, saving=True)
    return get_model_state_dict(model, options=opts), get_optimizer_state_dict(model, opt, options=opts)


def load_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer, opt_sd: dict[str, Any], mode: str,
                         env: DistEnv) -> None:
    """Load a consolidated optimizer state (any world size) into ``opt``. A listed parameter without state never
    had a gradient (e.g. the final norm of a raw readout) and gets none, as uninterrupted; ValueError for a
    trainable parameter the saved parameter groups do not list."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    listed = {fqn for group in opt_sd["param_groups"] for fqn in group["params"]}
    aliases: dict[int, list[str]] = {}
    for name, param in unwrap(model).named_parameters(remove_duplicate=False):
        if param.requires_grad:
            aliases.setdefault(id(param), []).append(name)
    missing = [names[0] for names in aliases.values() if not listed.intersection(names)]
    if missing:
        raise ValueError(f"checkpoint optimizer state: no entry for parameter(s) {missing}; the checkpoint "
                         "was saved from a model with other parameters")
    set_optimizer_state_dict(model, opt, opt_sd, options=_state_dict_options(mode, env, saving=False,
                                                                             strict=False))


def sharded_state(model: nn.Module, opt: torch.optim.Optimizer, saved: set[str] | None = None
                  ) -> tuple[dict, dict]:
    """Model and optimizer state dicts as this rank holds them (FQN keys; DTensor shards under FSDP2) for a
    sharded checkpoint; given the checkpoint's keys ``saved``, without the optimizer state of parameters it holds
    none for (as :func:`load_optimizer_state`). Collective under FSDP."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, opt_sd = get_state_dict(model, opt)
    if saved is not None:
        prefix = "optimizer.state."  # keys are optimizer.state.<fqn>.<moment>; moment names have no dots
        with_state = {k[len(prefix):].rsplit(".", 1)[0] for k in saved if k.startswith(prefix)}
        opt_sd["state"] = {fqn: v for fqn, v in opt_sd["state"].items() if fqn in with_state}
    return model_sd, opt_sd


def set_sharded_state(model: nn.Module, opt: torch.optim.Optimizer, model_sd: dict[str, Any],
                      opt_sd: dict[str, Any]) -> None:
    """Load filled :func:`sharded_state` dicts (strict for the model). Collective under FSDP."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    set_model_state_dict(model, model_sd, options=StateDictOptions(strict=True))
    set_optimizer_state_dict(model, opt, opt_sd, options=StateDictOptions(strict=False))


@contextlib.contextmanager
def _quiet_no_dist() -> Iterator[None]:
    """DCP warns on every call without a process group; reading or writing alone is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        yield


def save_shards(state_dict: dict[str, Any], path: Path, env: DistEnv) -> None:
    """``dcp.save`` of this rank's part of ``state_dict`` into ``path`` (collective when distributed)."""
    import torch.distributed.checkpoint as dcp

    with _quiet_no_dist():
        dcp.save(state_dict, checkpoint_id=path, no_dist=not env.enabled)


#: every global a DCP ``.metadata`` file may name (torch 2.6–2.13): data classes, enums, torch.Size, layouts
_DCP_GLOBALS = {("torch.distributed.checkpoint.metadata", n) for n in (
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
    "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata with only :data:`_DCP_GLOBALS` and torch dtypes resolvable, so a crafted
    ``.metadata`` cannot call arbitrary functions (DCP's own reader uses plain ``pickle.load``)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused global {module}.{name} (only DCP metadata types are loaded)")


def _safe_reader(path: Path):
    """A DCP ``FileSystemReader`` whose metadata is read by :class:`_MetadataUnpickler`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            with open(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


def _safe_planner():
    """DCP's default load planner, reading non-tensor entries with ``weights_only=True`` (not pickle)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._nested_dict import set_element

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafePlanner()


def load_shards(state_dict: dict[str, Any], path: Path, *, distributed: bool) -> None:
    """``dcp.load`` from ``path`` into ``state_dict`` in place, nothing unpickled beyond data; RuntimeError for a
    missing key, unreadable data or a metadata global that is not a DCP type."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _quiet_no_dist():
            dcp.load(state_dict, storage_reader=_safe_reader(path), planner=_safe_planner(),
                     no_dist=not distributed)
    except CheckpointException as exc:  # a BaseException carrying each failed rank's error and traceback
        reasons = "; ".join(f"rank {rank}: {type(err).__name__}: {err}" for rank, (err, _) in exc.failures.items())
        raise RuntimeError(reasons) from exc


def shard_keys(path: Path) -> set[str]:
    """Flattened keys (``model.<fqn>``, ``optimizer.state.<fqn>.exp_avg``, ...) of ``path``'s ``.metadata``."""
    try:
        return set(_safe_reader(path).read_metadata().state_dict_metadata)
    except Exception as exc:  # a missing or unpicklable .metadata raises several types
        raise RuntimeError(f"cannot read {path / '.metadata'} ({exc})") from exc


def barrier(env: DistEnv) -> None:
    if env.enabled:
        dist.barrier()
