"""The DeviceMesh a Layout names, and the process groups the runtime takes from it.

One 5-D mesh over (pp, dp_replicate, dp_shard, cp, tp) — size-1 dims included, in layout.MESH_DIMS
order — plus two flattened meshes: the data-parallel ranks (dp_replicate x dp_shard: who reads which
sequences) and the gradient ranks (those x cp: who reduces gradients and sums the loss, since each
context rank computes the gradient of its own tokens); with expert parallelism, a mesh over the same
ranks with dp_shard x cp split into (efsdp, ep): the MoE layer is token-wise, so a context rank's chunk
of a sequence is more tokens to dispatch, and ep borrows context ranks as it borrows data-parallel
ones. Everything else (FSDP's mesh, the replica group the sync check compares over) is a slice of it
chosen by the Layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from disttrain.layout.layout import MESH_DIMS, Layout


@dataclass(frozen=True)
class Meshes:
    world: DeviceMesh  # over (pp, dp_replicate, dp_shard, cp, tp)
    dp: DeviceMesh  # the data-parallel ranks (dp_replicate x dp_shard flattened): one slice of the batch each
    dp_cp: DeviceMesh  # the gradient ranks (dp_replicate x dp_shard x cp flattened); `dp` when cp = 1
    shard_cp: DeviceMesh | None = None  # dp_shard x cp flattened (FSDP's shard dim under cp); None when cp = 1
    experts: DeviceMesh | None = None  # over (pp, dp_replicate, efsdp, ep, tp): dp_shard x cp split for experts
    same_experts: DeviceMesh | None = None  # the ranks holding the same experts (dp_replicate x efsdp flattened)

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

    @property
    def cp(self) -> DeviceMesh:
        return self.world["cp"]

    def fsdp(self, layout: Layout) -> DeviceMesh:
        """FSDP shards over dp_shard (x cp), replicating over dp_replicate when HSDP."""
        shard = "dp_shard_cp" if layout.cp > 1 else "dp_shard"
        if len(layout.fsdp_dims) > 1:
            return self.world["dp_replicate", shard]
        return self.shard_cp if layout.cp > 1 else self.world["dp_shard"]

    def replica_group(self, layout: Layout):
        """The group whose ranks hold identical parameters (None: no replicas to compare)."""
        dims = layout.replica_dims
        if not dims:
            return None
        if dims == ("dp_replicate", "dp_shard"):
            return self.dp_cp.get_group()
        return self.world[dims[0]].get_group()


def build_meshes(layout: Layout, device_type: str) -> Meshes:
    world = init_device_mesh(device_type, layout.mesh_shape, mesh_dim_names=MESH_DIMS)
    experts = same_experts = None
    # `_flatten` gives one group over several dims; torch asks callers to keep the flattened mesh
    # themselves rather than slice it from the root again.
    if layout.ep > 1:  # expert-parallel ranks innermost within dp_shard x cp (neighbours: cp ranks first)
        pp, dpr, dps, cp, tp = layout.mesh_shape  # dp_shard and cp are adjacent: one dim of dps * cp ranks
        experts = DeviceMesh(device_type, world.mesh.reshape(pp, dpr, dps * cp // layout.ep, layout.ep, tp),
                             mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep", "tp"))
        same_experts = experts["dp_replicate", "efsdp"]._flatten("same_experts")
    dp = world["dp_replicate", "dp_shard"]._flatten("dp")
    if layout.cp == 1:
        return Meshes(world=world, dp=dp, dp_cp=dp, experts=experts, same_experts=same_experts)
    shard_cp = world["dp_shard", "cp"]._flatten("dp_shard_cp")
    dp_cp = world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
    return Meshes(world=world, dp=dp, dp_cp=dp_cp, shard_cp=shard_cp, experts=experts, same_experts=same_experts)
