"""What a joiner receives: the tracked objects, split into tensors (moved in place) and the rest.

Every tracked object is seen as a list of *tensors* that live in the object (parameters,
buffers, optimizer state) plus a picklable *rest* (hyper-parameters, scheduler state, plain
values). Tensors are received into the joiner's own, already allocated tensors; the rest is
applied after. Both sides walk the objects in the same order, so a tensor's index names it.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch

from tmrun.worker import pipeline
from tmrun.worker.optimizer import unwrap as _unwrap_optimizer


class TrackError(ValueError):
    """A tracked object cannot be moved (wrong kind, or the joiner's layout differs)."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: a DTensor's local shard (FSDP2, HSDP, tensor parallel:
    a view sharing storage with the live parameter or optimizer state, so receiving into it
    writes the live tensor), or ``t`` itself. Healing moves local shards only (docs/mesh.md)."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def _shard_coordinates(t: Any) -> tuple[tuple[int, int], ...]:
    """(mesh dimension, this rank's coordinate) for every dimension along which the DTensor
    ``t`` differs between ranks (a ``Shard`` or ``Partial`` placement); () for a plain tensor or
    a DTensor replicated everywhere, or on a rank outside its mesh."""
    placements = getattr(t, "placements", None)
    mesh = getattr(t, "device_mesh", None)
    if placements is None or mesh is None:
        return ()
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return ()
    return tuple((dim, int(coordinate[dim])) for dim, placement in enumerate(placements)
                 if not placement.is_replicate())


def _module_members(module: torch.nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """Every parameter and buffer ``module`` holds, by identity: ``(name, tensor, is_parameter)``.

    Never through ``state_dict()``: its hooks may return copies (a fused projection exposed as
    unfused q/k/v tensors, a parametrization's computed weight), into which a joiner's healing
    would write while its live parameters kept their fresh initialisation; a DTensor's
    ``state_dict`` hook may even run a collective (``redistribute``) inside healing. A tensor
    shared by several modules (tied weights) is walked once; a parametrized weight is moved as
    its ``original`` parameter(s); non-persistent buffers are moved too."""
    members: list[tuple[str, torch.Tensor, bool]] = []
    for name, param in module.named_parameters(remove_duplicate=True):
        members.append((name, param, True))
    for name, buffer in module.named_buffers(remove_duplicate=True):
        if isinstance(buffer, torch.Tensor):
            members.append((name, buffer, False))
    return members


def _optimizer_tensors(prefix: str, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    found = []
    index = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            for key in sorted(state):
                if isinstance(state[key], torch.Tensor):
                    found.append((f"{prefix}.state.{index}.{key}", local_shard(state[key])))
            index += 1
    return found


def _optimizer_rest(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    scalars: list[dict[str, Any]] = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            scalars.append({k: v for k, v in state.items() if not isinstance(v, torch.Tensor)})
    return {"groups": groups, "scalars": scalars}


def _apply_optimizer_rest(optimizer: torch.optim.Optimizer, rest: dict[str, Any]) -> None:
    for group, values in zip(optimizer.param_groups, rest["groups"]):
        group.update(values)
    index = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            if rest["scalars"][index]:
                optimizer.state.setdefault(param, {}).update(rest["scalars"][index])
            index += 1


def _syncs_buffers(model: torch.nn.parallel.DistributedDataParallel) -> bool:
    """Whether DDP broadcasts the module's buffers at every forward (torch 2.14 names it
    ``forward_sync_buffers``; up to 2.13 ``broadcast_buffers``)."""
    for attribute in ("forward_sync_buffers", "broadcast_buffers"):
        if hasattr(model, attribute):
            return bool(getattr(model, attribute))
    return True


def _unwrap(obj: Any) -> Any:
    """What is tracked of ``obj``: a DDP model's module, a guarded optimizer's optimizer."""
    if isinstance(obj, torch.nn.parallel.DistributedDataParallel):
        return obj.module
    return _unwrap_optimizer(obj)


class TrackedState:
    """The registry behind ``tm.track``; ``values`` holds the plain (picklable) values."""

    def __init__(self) -> None:
        self._objects: dict[str, Any] = {}
        self.values: dict[str, Any] = {}
        # state that differs by rank (a data loader keyed by data-parallel rank): never sent by a
        # donor; a joiner takes the record its rank published (tmrun.worker.per_rank_records)
        self._per_rank: dict[str, Any] = {}
        # ids of the tracked modules a DDP wrapper given to tm.track keeps the buffers of alike
        # (it broadcasts them at every forward: torch's default)
        self._buffers_synced: set[int] = set()
        # the part of the job's state this rank holds where no DTensor says so (a pipeline
        # stage): tm.set_shard; part of shard_key
        self.shard_label: Optional[str] = None
        # pipeline schedules (tm.track(schedule=...)): no state of their own to heal; their
        # start-up runs again where a joiner enters their pipeline (tmrun.worker.pipeline)
        self.pipelines: list = []
        self.on_pipeline: Optional[Callable[[Any], None]] = None  # told of each schedule tracked
        # module id -> its members, while :meth:`walked_once` holds (a healing walks them ~8 times)
        self._members_cache: Optional[dict[int, list[tuple[str, torch.Tensor, bool]]]] = None

    @contextlib.contextmanager
    def walked_once(self) -> Iterator[None]:
        """Within this block each tracked module's parameters and buffers are walked once
        (``named_parameters`` / ``named_buffers`` over every submodule: about 2 ms per walk for a
        model of 100 parameters, and a healing asks for them about eight times). For a span in
        which no module gains or loses a parameter or buffer (healing: tensors are written in
        place). Nested blocks share the outer one's walk."""
        if self._members_cache is not None:
            yield
            return
        self._members_cache = {}
        try:
            yield
        finally:
            self._members_cache = None

    def _members(self, module: torch.nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
        cache = self._members_cache
        if cache is None:
            return _module_members(module)
        if id(module) not in cache:
            cache[id(module)] = _module_members(module)
        return cache[id(module)]

    def set_shard(self, label: Any) -> None:
        """This rank holds part ``label`` of the tracked state (a pipeline stage's index): only
        ranks with equal labels (and equal DTensor shards) are replicas of each other."""
        try:
            text = repr(label)
            hash(label)
        except Exception as exc:  # noqa: BLE001
            raise TrackError(f"tm.set_shard({label!r}): the label must be hashable and printable ({exc})") from None
        if self.shard_label is not None and self.shard_label != text:
            raise TrackError(f"tm.set_shard({label!r}): this rank's shard is {self.shard_label} already")
        self.shard_label = text

    def track(self, **objects: Any) -> None:
        for name, obj in objects.items():
            if name in self._per_rank:
                raise TrackError(f"tm.track({name}=...): {name!r} is tracked per rank already")
            if pipeline.is_schedule(obj):
                pipeline.check_supported(obj)
                if all(obj is not known for known in self.pipelines):
                    self.pipelines.append(obj)
                    if self.on_pipeline is not None:
                        self.on_pipeline(obj)
                continue
            if isinstance(obj, torch.nn.parallel.DistributedDataParallel) and _syncs_buffers(obj):
                self._buffers_synced.add(id(obj.module))
            obj = _unwrap(obj)
            if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)) or (
                hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")
            ):
                self._objects[name] = obj
            else:
                try:
                    pickle.dumps(obj)
                except Exception as exc:
                    raise TrackError(f"tm.track({name}=...): not a module, optimizer, object with "
                                     f"state_dict/load_state_dict, or picklable value ({exc})") from None
                self.values[name] = obj

    def track_per_rank(self, **objects: Any) -> None:
        """Objects whose state differs by rank (``state_dict`` / ``load_state_dict``): a joiner
        receives the lost rank's own record, survivors keep theirs."""
        for name, obj in objects.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TrackError(f"tm.track_per_rank({name}=...): needs state_dict() and load_state_dict()")
            if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
                raise TrackError(f"tm.track_per_rank({name}=...): modules and optimizers are healed from "
                                 "their replicas; give them to tm.track")
            if name in self._objects or name in self.values:
                raise TrackError(f"tm.track_per_rank({name}=...): {name!r} is tracked already")
            self._per_rank[name] = obj

    @property
    def per_rank(self) -> bool:
        return bool(self._per_rank)

    def per_rank_blob(self) -> bytes:
        """This rank's per-rank state, serialised (what its joiner would load)."""
        buffer = io.BytesIO()
        torch.save({name: obj.state_dict() for name, obj in self._per_rank.items()}, buffer)
        return buffer.getvalue()

    def apply_per_rank(self, blob: bytes) -> None:
        """Load a rank's record (:meth:`per_rank_blob`) into this process's per-rank objects."""
        states = torch.load(io.BytesIO(blob), weights_only=False)
        missing = sorted(set(self._per_rank) - set(states))
        if missing:
            raise TrackError(f"the rank's per-rank record lacks {', '.join(map(repr, missing))}")
        for name, obj in self._per_rank.items():
            obj.load_state_dict(states[name])

    def snapshot_per_rank(self) -> dict[str, Any]:
        return {name: copy.deepcopy(obj.state_dict()) for name, obj in self._per_rank.items()}

    def restore_per_rank(self, snapshot: dict[str, Any]) -> None:
        for name, obj in self._per_rank.items():
            if name in snapshot:
                obj.load_state_dict(copy.deepcopy(snapshot[name]))

    @property
    def names(self) -> list[str]:
        return list(self._objects) + list(self.values) + list(self._per_rank)

    def replica_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """What replicas must hold alike, for the replica check (tmrun.worker.replica_check):
        every tracked module's parameters (local shards) and every optimizer's state tensors.
        Buffers are left out: some legitimately differ by rank (batch-norm statistics under
        DDP with ``broadcast_buffers=False``)."""
        found: list[tuple[str, torch.Tensor]] = []
        for name, obj in self._objects.items():
            if isinstance(obj, torch.nn.Module):
                found += [(f"{name}.{key}", local_shard(t)) for key, t, is_param in self._members(obj) if is_param]
            elif isinstance(obj, torch.optim.Optimizer):
                found += _optimizer_tensors(name, obj)
        return found

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        found: list[tuple[str, torch.Tensor]] = []
        for name, obj in self._objects.items():
            if isinstance(obj, torch.nn.Module):
                # the live parameters and buffers themselves (a DTensor's local shard shares their storage)
                found += [(f"{name}.{key}", local_shard(t)) for key, t, _ in self._members(obj)]
            elif isinstance(obj, torch.optim.Optimizer):
                found += _optimizer_tensors(name, obj)
        return found

    def optimized_ids(self) -> set[int]:
        """The ids of the parameters the tracked optimizers step."""
        return {id(param) for optimizer in self._optimizers().values()
                for group in optimizer.param_groups for param in group["params"]}

    def modules(self) -> list[torch.nn.Module]:
        """The tracked modules (a DDP model's inner module)."""
        return [obj for obj in self._objects.values() if isinstance(obj, torch.nn.Module)]

    def modules_with_own_buffers(self) -> list[torch.nn.Module]:
        """The tracked modules whose buffers no DDP broadcast keeps alike across ranks."""
        return [module for module in self.modules() if id(module) not in self._buffers_synced]

    def _stateful(self) -> dict[str, Any]:
        return {name: obj for name, obj in self._objects.items()
                if not isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))}

    def _optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {name: obj for name, obj in self._objects.items() if isinstance(obj, torch.optim.Optimizer)}

    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """The tracked optimizers by name (a guard's optimizer)."""
        return self._optimizers()

    def objects(self) -> dict[str, Any]:
        """The tracked objects by name (modules, optimizers, objects with a state_dict), not the
        plain values nor the per-rank ones."""
        return dict(self._objects)

    def snapshot_stateful(self) -> dict[str, Any]:
        """A copy of what a step may change besides tensors: the state of every tracked object
        that is neither a module nor an optimizer (LR schedulers, gradient scalers, data loaders,
        samplers) and the optimizers' hyper-parameters (an LR scheduler writes ``lr`` into
        them). Taken when a step starts, so that a step a failure aborts can be undone
        (:meth:`restore_stateful`); the optimizers' tensors need no copy (an aborted step never
        applies its update)."""
        snapshot: dict[str, Any] = {name: copy.deepcopy(obj.state_dict()) for name, obj in self._stateful().items()}
        for name, optimizer in self._optimizers().items():
            snapshot[name] = copy.deepcopy(_optimizer_rest(optimizer)["groups"])
        return snapshot

    def restore_stateful(self, snapshot: dict[str, Any]) -> None:
        """Put those back as :meth:`snapshot_stateful` found them (a scheduler stepped, an LR
        changed, a scaler updated or a loader advanced by the aborted step goes back)."""
        for name, obj in self._stateful().items():
            if name in snapshot:
                obj.load_state_dict(copy.deepcopy(snapshot[name]))
        for name, optimizer in self._optimizers().items():
            for group, values in zip(optimizer.param_groups, snapshot.get(name, [])):
                group.update(copy.deepcopy(values))

    def deferrable(self) -> set[str]:
        """Names of the tensors a joiner needs only when the optimizer steps (optimizer state):
        a migration may deliver them while the joiner already runs forward and backward."""
        return {name for name, obj in self._objects.items() if isinstance(obj, torch.optim.Optimizer)}

    def allocate_missing(self, donor_specs: list[TensorSpec]) -> None:
        """Create optimizer state the donor has and this member has not allocated yet (an
        optimizer that never stepped), so that everything can be received in place."""
        have = {name for name, _ in self.tensors()}
        params_of: dict[str, list[torch.Tensor]] = {}  # per optimizer, its parameters in state order
        for spec in donor_specs:
            if spec.name in have:
                continue
            name, _, rest = spec.name.partition(".state.")
            optimizer = self._objects.get(name)
            if not isinstance(optimizer, torch.optim.Optimizer) or not rest:
                raise TrackError(f"the donor has tensor {spec.name!r} and this member has not")
            index_text, _, key = rest.partition(".")
            if name not in params_of:
                params_of[name] = [p for group in optimizer.param_groups for p in group["params"]]
            param = params_of[name][int(index_text)]
            dtype = getattr(torch, spec.dtype.removeprefix("torch."))
            if local_shard(param) is not param and spec.shape and tuple(local_shard(param).shape) == spec.shape:
                # a DTensor sharded as its parameter, made as torch's optimizers make their state
                # (same arguments): DTensor's dispatch then finds the sharding a standby's
                # rehearsal cached; with other arguments each call is a first use (an HSDP
                # joiner's 202 took 45 ms of its healing, against 5 ms so)
                value = (torch.zeros_like(param, memory_format=torch.preserve_format) if dtype == param.dtype
                         else torch.zeros_like(param, dtype=dtype))
            else:
                value = torch.zeros(spec.shape, dtype=dtype, device=param.device)
            optimizer.state.setdefault(param, {})[key] = value

    def shard_key(self) -> int:
        """Which shard of the model this member holds, as a 63-bit digest: for every tracked
        module tensor that is a DTensor, its name and its mesh coordinate along each dimension
        where it is sharded (``Shard``) or partial; ``Replicate`` dimensions (HSDP's
        "replicate") do not count; the label of :meth:`set_shard`; and the stage indices of the
        tracked pipeline schedules (stages of equal shapes are different shards). Members
        with equal keys are replicas and can heal each other; 0 when nothing is sharded (DDP:
        every member is a replica). docs/mesh.md."""
        sharded: list = [("tm.set_shard", self.shard_label)] if self.shard_label is not None else []
        stages = sorted(stage.stage_index for schedule in self.pipelines for stage in pipeline.stages_of(schedule))
        if stages:  # a tracked pipeline schedule: its stages are this rank's shard too
            sharded.append(("pipeline stages", tuple(stages)))
        for name, obj in self._objects.items():
            if not isinstance(obj, torch.nn.Module):
                continue
            for key, value, _ in self._members(obj):
                coords = _shard_coordinates(value)
                if coords:
                    sharded.append((f"{name}.{key}", coords))
        if not sharded:
            return 0
        return int.from_bytes(hashlib.sha256(repr(sharded).encode()).digest()[:8], "little") >> 1 or 1

    def specs(self) -> list[TensorSpec]:
        return [TensorSpec(name, tuple(t.shape), str(t.dtype)) for name, t in self.tensors()]

    def layout_digest(self) -> int:
        """A 63-bit digest of names, shapes and dtypes: equal on every member with the same layout."""
        text = repr([(s.name, s.shape, s.dtype) for s in self.specs()]).encode()
        return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1

    def rest(self) -> bytes:
        """Everything that is not a tracked tensor, pickled."""
        payload: dict[str, Any] = {"values": dict(self.values), "objects": {}}
        for name, obj in self._objects.items():
            if isinstance(obj, torch.nn.Module):
                continue
            if isinstance(obj, torch.optim.Optimizer):
                payload["objects"][name] = ("optimizer", _optimizer_rest(obj))
            else:
                buffer = io.BytesIO()
                torch.save(obj.state_dict(), buffer)
                payload["objects"][name] = ("stateful", buffer.getvalue())
        return pickle.dumps(payload)

    def apply_rest(self, blob: bytes) -> None:
        payload = pickle.loads(blob)
        self.values.update(payload["values"])
        for name, (kind, data) in payload["objects"].items():
            obj = self._objects.get(name)
            if obj is None:
                raise TrackError(f"the donor tracks {name!r} but this member does not")
            if kind == "optimizer":
                _apply_optimizer_rest(obj, data)
            else:
                obj.load_state_dict(torch.load(io.BytesIO(data), weights_only=False))
