"""torch.distributed under torchrun: who am I, and agreeing on decisions across ranks."""

from __future__ import annotations

import atexit
import ctypes
import datetime
import functools
import gc
import os
from typing import Any, cast

import torch
import torch.distributed as dist
from attrs import define, field

from coretrain.config import DistributedConfig, world_size_from_env


@define(frozen=True)
class DistInfo:
    """Who this process is. Ranks form a (pipeline × data parallel × context × tensor parallel)
    grid, tensor parallel innermost (the ranks of one TP group are neighbours, on one machine), as in
    torchtitan and Megatron: ranks ``dp_rank * tp_size .. + tp_size - 1`` share one batch.
    With HSDP the data-parallel ranks are themselves (dp_replicate × dp_shard), shard innermost."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    tp_size: int = 1
    cp_size: int = 1
    """Context parallel: neighbouring ranks (outside the TP group) splitting each sequence."""
    pp_size: int = 1
    """Pipeline parallel: the outermost split, each part of the ranks holding one stage of the model."""
    dp_replicate: int = 1
    ep_size: int = 1
    """Expert parallel: the data-parallel (and context) ranks a mixture of experts' experts are
    spread over, innermost of them (torchtitan's dp_shard_in_ep × cp)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: how many different batches one step reads."""
        return self.world_size // self.tp_size // self.cp_size // self.pp_size

    @property
    def dp_rank(self) -> int:
        """Which of those batches this rank reads (the same for every rank of a TP or CP group)."""
        return self.rank // (self.tp_size * self.cp_size) % self.dp_size


def init_distributed(device_type: str, config: DistributedConfig) -> tuple[DistInfo, RunGroups]:
    """Join the process group torchrun set up (gloo on CPU, nccl on CUDA), once the layout the
    config asks for fits the ranks (a single process otherwise); who this process is, and the
    new run's groups, which this process's decisions go over from now on."""
    world_size = world_size_from_env()
    config.check_layout(world_size)
    global _current
    _current = RunGroups(datetime.timedelta(seconds=config.init_timeout_seconds))
    if world_size == 1:
        return DistInfo(), _current
    if not dist.is_initialized():
        chosen = config.backend if config.backend != "auto" else ("nccl" if device_type == "cuda" else "gloo")
        dist.init_process_group(chosen, timeout=_current.timeout)
    layout = {name: getattr(config, name) for name in ("tp_size", "cp_size", "pp_size", "dp_replicate", "ep_size")}
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), **layout), _current


def mesh_dims(info: DistInfo) -> dict[str, int]:
    """The mesh's dims, outermost first: "pp" with pipeline parallelism, ("dp",) or with HSDP
    ("dp_replicate", "dp_shard"), then "cp" with context parallelism, "tp" with tensor parallelism.
    With expert parallelism the sharded data-parallel ranks are two dims, ("dp_mod_ep",
    "dp_in_ep"): the experts are spread over "dp_in_ep" × "cp" (torchtitan's split)."""
    shards = info.dp_size // info.dp_replicate
    dims = {"pp": info.pp_size, "dp_replicate": info.dp_replicate}
    if info.ep_size > 1:
        inside = info.ep_size // info.cp_size  # the data-parallel ranks of one expert group
        dims |= {"dp_mod_ep": shards // inside, "dp_in_ep": inside}
    else:
        dims[("dp_shard" if info.dp_replicate > 1 else "dp")] = shards
    if info.dp_replicate == 1:
        del dims["dp_replicate"]
    dims |= {"cp": info.cp_size, "tp": info.tp_size}
    return {name: size for name, size in dims.items() if size > 1 or name.startswith("dp")}


def flattened_dims(dims: dict[str, int]) -> dict[str, tuple[str, ...]]:
    """Names for groups of dims: "dp" every data-parallel rank, "dp_cp" (and with HSDP
    "dp_shard_cp") the data and context ranks, "dp_tp" all ranks with TP; with expert parallelism
    also "dp_shard" a replica's data-parallel ranks, "ep" the ranks one expert group spreads over
    and "edp" the ranks holding copies of the same experts (each of these from the dims there
    are: one dim alone, too)."""
    data = tuple(name for name in dims if name.startswith("dp"))
    shard = ("dp_mod_ep", "dp_in_ep") if "dp_in_ep" in dims else ("dp_shard",)
    flat = {"dp": data, "dp_cp": (*data, "cp"), "dp_shard_cp": (*shard, "cp"), "dp_tp": (*data, "tp")}
    flat = {name: parts for name, parts in flat.items() if len(parts) > 1 and all(part in dims for part in parts)}
    if "dp_in_ep" in dims:
        wanted = {"dp_shard": shard, "ep": ("dp_in_ep", "cp"), "edp": ("dp_replicate", "dp_mod_ep")}
        flat |= {name: tuple(part for part in parts if part in dims) for name, parts in wanted.items()}
    return flat


@define
class RunGroups:
    """The process groups a run makes besides the default one, each at its first use (making one
    is collective: every rank asks): the run's DeviceMesh and the gloo group its decisions go
    over. Held by the run (``run.groups``); each run makes its own (:func:`init_distributed`, an
    in-process restart's too), and :func:`shutdown` lets the current one go with the groups."""

    timeout: datetime.timedelta = datetime.timedelta(minutes=10)
    """For the decisions' group: ``distributed.init_timeout_seconds``."""
    _mesh: Any = field(default=None, init=False)

    def mesh(self, device_type: str, info: DistInfo) -> Any:
        """The run's DeviceMesh, with :func:`mesh_dims`; "dp" always names every data-parallel
        rank (with HSDP, the two dims flattened into one), "dp_tp" all ranks with TP, "dp_cp"
        (and with HSDP "dp_shard_cp") the data and context ranks.

        Parallelism plugins share it (FSDP2 shards over ``mesh["dp"]``, tensor parallelism
        splits over ``mesh["tp"]``): a 2-D layout works only when both come from one mesh. A
        single process gets a process group of one."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            if not dist.is_initialized():
                store = dist.HashStore()  # type: ignore[attr-defined]
                dist.init_process_group("gloo" if device_type == "cpu" else "nccl", rank=0, world_size=1, store=store)
            dims = mesh_dims(info)
            self._mesh = init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))
            # "dp_cp": the ranks that average gradients, every batch and every chunk of it (with
            # HSDP a replica's "dp_shard_cp"); "dp_tp": one group over both (torchtitan's too), so
            # that a norm partial on both, as gradient clipping has, is reduced once, not per dim
            for name, parts in flattened_dims(dims).items():
                self._mesh[parts]._flatten(name)
        return self._mesh

    @functools.cached_property
    def control(self) -> object:
        """A gloo group for decisions, so agreeing never syncs the GPU stream (None = the default
        group, already gloo); decided at the first — it is asked every step."""
        return None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=self.timeout)


_current = RunGroups()
"""The groups of the run in progress: :func:`max_over_ranks` decides over its gloo group."""


_kept: list[object] = []
atexit.register(_kept.clear)  # while the interpreter is whole: a group's threads can end then
groups_left: list[str] = []
"""Groups a failed run left, never destroyed (:func:`shutdown`): the CLI then ends its process
without the interpreter's finalization (``coretrain.__main__``)."""


def max_over_ranks(*values: int) -> list[int]:
    """Element-wise maxima over all ranks (one tiny CPU all-reduce; free when single-process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    tensor = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=_current.control)
    return tensor.tolist()


class OneStepLate:
    """Maxima over ranks without blocking: the values proposed at one step are all-reduced in
    the background and read at the next, by when the tiny CPU all-reduce has long finished.

    Every rank calls :meth:`exchange` once per step, so all of them act on the same agreed
    values at the same step — one step after the proposal (DESIGN: agreement must not put a
    blocking collective on every step)."""

    def __init__(self, size: int) -> None:
        self._values = torch.zeros(size, dtype=torch.int64)
        self._work: Any = None

    def exchange(self, *proposal: int, now: bool = False) -> list[int]:
        """The agreed maxima of the previous step's proposals (zeros at the first); propose these.

        ``now``: on a step that decides something anyway (a checkpoint is due), agree on these
        proposals too, blocking — a stop that forbids saving must stop the save it coincides with."""
        agreed = [0] * len(proposal)
        if self._work is not None:
            self._work.wait()  # finished a step ago: returns at once
            agreed = self._values.tolist()
            self._work = None
        if now:
            return [max(a, b) for a, b in zip(agreed, max_over_ranks(*proposal))]
        self._values = torch.tensor(proposal, dtype=torch.int64)
        self._work = dist.all_reduce(self._values, op=dist.ReduceOp.MAX, group=_current.control, async_op=True)
        return agreed

    def finish(self) -> None:
        """Wait for the proposal in flight (before the ranks' next collectives or shutdown)."""
        if self._work is not None:
            self._work.wait()
            self._work = None


def sum_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """In-place sum over ranks (free when single-process)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def mean_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """In-place mean over ranks (SUM then divide: gloo has no AVG)."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return sum_over_ranks(tensor).div_(world) if world > 1 else tensor


def _forget_sharding_plans() -> None:
    """Empty DTensor's caches of sharding plans (its C++ one and Python's) and torch 2.9's maps of
    flattened meshes. A DeviceMesh equals another of the same ranks and dim names whatever its
    process groups, so a later run in this process (in-process restart, a notebook, a test's job)
    was handed plans, or on torch 2.9 a flattened mesh ("dp_shard_cp"), on the groups just
    destroyed: "Could not resolve the process group", or a sum over too few ranks, silently
    (Megatron-LM clears the same cache at teardown)."""
    from torch.distributed import device_mesh
    from torch.distributed.tensor import DTensor

    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()
    cast(Any, DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding).cache.cache_clear()  # (untyped)
    for held in ("child_to_root_mapping", "root_to_flatten_mapping", "flatten_name_to_root_dims"):
        getattr(device_mesh._mesh_resources, held, {}).clear()  # torch 2.9's flattened meshes, by their root


def shutdown(graceful: bool = False) -> None:
    """Leave the process group; ``graceful`` first waits for every rank, so no rank tears down
    its connections while another is still in a collective (gloo aborts on that).

    Every group gets a reference of its own here, so that its last one is never DDP's reducer's:
    the reducer's destructor destroys a gloo group holding the GIL, and joins its worker thread,
    which needs the GIL to let go of the tensors of a collective it is just ending — deadlock
    (one job in four, with 2 ranks failing together under load). A finished run's groups are let
    go at the next shutdown or at exit, their threads idle. A failed run's are never let go: a
    collective may still be pending there (one a peer never joined: joining its thread would
    wait for gloo's timeout), and a thread that ends one during the interpreter's finalization
    cannot take the GIL and aborts the process (exit -6), so the CLI does not finalize then."""
    global _current
    if graceful and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    _current = RunGroups()
    if dist.is_available() and dist.is_initialized():
        groups = list(dist.distributed_c10d._world.pg_map)
        _kept[:] = groups if graceful else _kept
        for group in [] if graceful else groups:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
            groups_left.append(repr(group))
        # free the run's cycles (DDP's reducer, FSDP's groups) while the interpreter is whole: a
        # gloo group they keep alive is otherwise destroyed during finalization, where its worker
        # threads cannot take the GIL and the process aborts ("terminate called without an
        # active exception", exit -6) after a run that succeeded
        gc.collect()
        dist.destroy_process_group()
        gc.collect()
        _forget_sharding_plans()
