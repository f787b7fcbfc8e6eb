"""The parallel layout: degrees from [parallelism], their checks, and the one device mesh.

Mesh dimensions, outermost first: pp (pipeline stages), dp_replicate (HSDP replicas), dp_shard
(FSDP), cp (context: parts of each sequence), tp. Flattened groups:
  dp           dp_replicate x dp_shard: which samples a rank reads (pp, cp and tp ranks share them)
  dp_shard_cp  dp_shard x cp: FSDP shards over it (cp ranks hold the same weights, other tokens)
  dp_cp        dp_replicate x dp_shard x cp: every rank holding different tokens (loss, counts)
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
    cp: int
    tp: int
    world_size: int
    fsdp_single_device: bool = False

    @classmethod
    def from_config(cls, config: Parallelism, world_size: int) -> "ParallelDims":
        pp, replicate, shard, cp, tp = (
            config.pipeline_parallel_degree,
            config.data_parallel_replicate_degree,
            config.data_parallel_shard_degree,
            config.context_parallel_degree,
            config.tensor_parallel_degree,
        )
        others = pp * replicate * cp * tp
        if shard == -1:
            if world_size % others:
                raise ConfigError(
                    f"world size {world_size} is not divisible by the pipeline x replicate x context x "
                    f"tensor parallel degrees = {pp} x {replicate} x {cp} x {tp}"
                )
            shard = world_size // others
        if pp * replicate * shard * cp * tp != world_size:
            raise ConfigError(
                f"parallelism degrees multiply to {pp} x {replicate} x {shard} x {cp} x {tp} = "
                f"{pp * replicate * shard * cp * tp} (pipeline x replicate x shard x context x tensor) "
                f"but the world size is {world_size}"
            )
        return cls(pp, replicate, shard, cp, tp, world_size, config.fsdp_single_device)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different slices of each global batch are read."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP also sums the gradients of context-parallel ranks."""
        return self.dp * self.cp > 1 or self.fsdp_single_device

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        names = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
        shape = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        return mesh

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """HSDP shards over dp_shard x cp and replicates over dp_replicate (2-D mesh); FSDP is 1-D."""
        return mesh["dp_replicate", "dp_shard_cp"] if self.dp_replicate > 1 else mesh["dp_shard_cp"]

    def check_sequence_split(self, seq_len: int) -> None:
        if self.cp_enabled and seq_len % (2 * self.cp):
            raise ConfigError(
                f"training.seq_len ({seq_len}) must divide into 2 x context_parallel_degree = "
                f"{2 * self.cp} chunks"
            )
        local = seq_len // self.cp
        if self.tp_enabled and local % self.tp:  # sequence parallelism splits a rank's tokens
            what = f"training.seq_len ({seq_len})"
            if self.cp_enabled:
                what = f"the {local} tokens per context-parallel rank (training.seq_len / {self.cp})"
            raise ConfigError(f"tensor_parallel_degree {self.tp} does not divide {what}")

    def check_divisibility(self, sizes: dict[str, int]) -> None:
        """Every named size (heads, vocabulary, sequence length...) must split evenly over tp."""
        for name, size in sizes.items():
            if size % self.tp:
                raise ConfigError(f"tensor_parallel_degree {self.tp} does not divide {name} ({size})")

    def describe(self) -> str:
        return (
            f"world {self.world_size} = pp {self.pp} x dp_replicate {self.dp_replicate} x dp_shard "
            f"{self.dp_shard} x cp {self.cp} x tp {self.tp}"
        )
