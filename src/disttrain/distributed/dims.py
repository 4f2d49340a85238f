"""ParallelDims: the four layout degrees, checked against the world size, and the DeviceMesh they name.

Mesh dimension order, outermost first: pp, dp_replicate, dp_shard, tp. Tensor parallel is
innermost so its ranks share a node (NVLink); pipeline outermost so its point-to-point traffic
is what crosses nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int

    @classmethod
    def from_config(cls, parallel, world_size: int) -> "ParallelDims":
        from disttrain.config import ConfigError

        fixed = parallel.dp_replicate * parallel.tp * parallel.pp
        dp_shard = parallel.dp_shard
        if dp_shard == -1:
            if world_size % fixed:
                raise ConfigError(
                    f"parallel.dp_replicate={parallel.dp_replicate} x parallel.tp={parallel.tp} x "
                    f"parallel.pp={parallel.pp} = {fixed} does not divide the world size {world_size}")
            dp_shard = world_size // fixed
        if fixed * dp_shard != world_size:
            raise ConfigError(
                f"parallel.dp_replicate={parallel.dp_replicate} x parallel.dp_shard={dp_shard} x "
                f"parallel.tp={parallel.tp} x parallel.pp={parallel.pp} = {fixed * dp_shard} does not equal "
                f"the world size {world_size}")
        return cls(parallel.dp_replicate, dp_shard, parallel.tp, parallel.pp, world_size)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    def build_mesh(self, device_type: str) -> "Meshes":
        """The named 4-D mesh (size-1 dims included) and the flattened data-parallel mesh."""
        from torch.distributed.device_mesh import init_device_mesh

        world = init_device_mesh(device_type, self.shape(), mesh_dim_names=MESH_DIMS)
        # `_flatten` (as torchtitan uses it) gives one group over both dp dims; torch asks callers
        # to keep the flattened mesh themselves rather than slice it from the root again.
        return Meshes(world=world, dp=world["dp_replicate", "dp_shard"]._flatten("dp"))


@dataclass(frozen=True)
class Meshes:
    world: object  # DeviceMesh over (pp, dp_replicate, dp_shard, tp)
    dp: object  # DeviceMesh over the data-parallel ranks (dp_replicate x dp_shard flattened)
