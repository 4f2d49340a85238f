"""The DeviceMesh a Layout names, and the process groups the runtime takes from it.

One 4-D mesh over (pp, dp_replicate, dp_shard, tp) — size-1 dims included, in layout.MESH_DIMS
order — plus the flattened data-parallel mesh, and with expert parallelism a 5-D mesh over the same
ranks with dp_shard split into (efsdp, ep). Everything else (FSDP's mesh, the replica group
the sync check compares over) is a slice of it chosen by the Layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from disttrain.layout import MESH_DIMS, Layout


@dataclass(frozen=True)
class Meshes:
    world: DeviceMesh  # over (pp, dp_replicate, dp_shard, tp)
    dp: DeviceMesh  # the data-parallel ranks (dp_replicate x dp_shard flattened)
    experts: DeviceMesh | None = None  # over (pp, dp_replicate, efsdp, ep, tp): dp_shard split for experts

    @property
    def ep(self) -> DeviceMesh:
        return self.experts["ep"]

    def efsdp(self, layout: Layout) -> DeviceMesh:
        """The data-parallel ranks holding the same experts (HSDP: replicate x efsdp)."""
        return self.experts["dp_replicate", "efsdp"] if layout.dp_replicate > 1 else self.experts["efsdp"]

    @property
    def tp(self) -> DeviceMesh:
        return self.world["tp"]

    @property
    def pp(self) -> DeviceMesh:
        return self.world["pp"]

    def fsdp(self, layout: Layout) -> DeviceMesh:
        dims = layout.fsdp_dims
        return self.world[dims] if len(dims) > 1 else self.world[dims[0]]

    def replica_group(self, layout: Layout):
        """The group whose ranks hold identical parameters (None: no replicas to compare)."""
        dims = layout.replica_dims
        if not dims:
            return None
        if dims == ("dp_replicate", "dp_shard"):
            return self.dp.get_group()
        return self.world[dims[0]].get_group()


def build_meshes(layout: Layout, device_type: str) -> Meshes:
    world = init_device_mesh(device_type, layout.mesh_shape, mesh_dim_names=MESH_DIMS)
    experts = None
    if layout.ep > 1:  # expert-parallel ranks innermost within dp_shard (neighbours, like tensor parallel)
        pp, dpr, dps, tp = layout.mesh_shape
        experts = DeviceMesh(device_type, world.mesh.reshape(pp, dpr, dps // layout.ep, layout.ep, tp),
                             mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep", "tp"))
    # `_flatten` gives one group over both dp dims; torch asks callers to keep the flattened mesh
    # themselves rather than slice it from the root again.
    return Meshes(world=world, dp=world["dp_replicate", "dp_shard"]._flatten("dp"), experts=experts)
