"""The parallel layout: degrees from [parallelism], their checks, and the one device mesh.

Mesh dimensions, outermost first: pp (pipeline stages), dp_replicate (HSDP replicas), dp_shard
(FSDP), tp. Ranks that differ only in pp or tp read the same data; "dp" (dp_replicate x dp_shard,
flattened) indexes the data.
"""

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from configs import ConfigError
from configs.schema import Parallelism


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    fsdp_single_device: bool = False

    @classmethod
    def from_config(cls, config: Parallelism, world_size: int) -> "ParallelDims":
        pp, replicate, shard, tp = (
            config.pipeline_parallel_degree,
            config.data_parallel_replicate_degree,
            config.data_parallel_shard_degree,
            config.tensor_parallel_degree,
        )
        others = pp * replicate * tp
        if shard == -1:
            if world_size % others:
                raise ConfigError(
                    f"world size {world_size} is not divisible by pipeline x data_parallel_replicate x "
                    f"tensor parallel degrees = {pp} x {replicate} x {tp}"
                )
            shard = world_size // others
        if pp * replicate * shard * tp != world_size:
            raise ConfigError(
                f"parallelism degrees multiply to {pp} x {replicate} x {shard} x {tp} = "
                f"{pp * replicate * shard * tp} (pipeline x replicate x shard x tensor) but the world "
                f"size is {world_size}"
            )
        return cls(pp, replicate, shard, tp, world_size, config.fsdp_single_device)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different slices of each global batch are read."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp > 1 or self.fsdp_single_device

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        names = ("pp", "dp_replicate", "dp_shard", "tp")
        shape = (self.pp, self.dp_replicate, self.dp_shard, self.tp)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        mesh["dp_replicate", "dp_shard"]._flatten("dp")  # one group over all data-parallel ranks
        return mesh

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """HSDP shards over dp_shard and replicates over dp_replicate (2-D mesh); FSDP is 1-D."""
        return mesh["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else mesh["dp_shard"]

    def check_divisibility(self, sizes: dict[str, int]) -> None:
        """Every named size (heads, vocabulary, sequence length...) must split evenly over tp."""
        for name, size in sizes.items():
            if size % self.tp:
                raise ConfigError(f"tensor_parallel_degree {self.tp} does not divide {name} ({size})")

    def describe(self) -> str:
        return (
            f"world {self.world_size} = pp {self.pp} x dp_replicate {self.dp_replicate} x dp_shard "
            f"{self.dp_shard} x tp {self.tp}"
        )
