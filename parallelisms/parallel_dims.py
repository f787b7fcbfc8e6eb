"""The parallel layout: degrees from [parallelism], their checks, and the one device mesh.

Mesh dimensions, outermost first: pp (pipeline stages), dp_replicate (HSDP replicas), dp_shard
(FSDP), cp (context: parts of each sequence), tp. Groups across several of them:
  dp     dp_replicate x dp_shard: which samples a rank reads (pp, cp and tp ranks share them)
  dp_cp  dp_replicate x dp_shard x cp: every rank holding different tokens (loss, counts)
  fsdp   what FSDP shards over: dp_shard x cp (cp ranks hold the same weights, other tokens);
         for HSDP the 2-D (dp_replicate, dp_shard_cp)

With expert parallelism a second root mesh lays out the same ranks for the experts of MoE layers:
(pp, dp_replicate, efsdp, ep, tp), where efsdp x ep = dp_shard x cp (ep the inner ranks). Groups:
  ep            the ranks that share their tokens' experts (an expert's weights live on one of them)
  expert_tp     ep x tp: the experts' DTensor mesh (tp ranks hold the same experts, as under TP alone)
  expert_fsdp   what FSDP shards the experts over: efsdp, or (dp_replicate, efsdp) for HSDP
"""

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from configs import UserError
from configs.schema import Parallelism


class Meshes:
    """The run's device mesh by name: a layout dimension, or one of the groups above.

    torch wants flattened meshes kept by whoever made them rather than sliced from the root mesh
    again (deprecated since 2.11), so they are made once, in build_mesh, and kept here.
    """

    def __init__(self, layout: DeviceMesh, groups: dict[str, DeviceMesh]):
        self.layout = layout
        self.groups = groups

    def __getitem__(self, name: str) -> DeviceMesh:
        return self.groups[name] if name in self.groups else self.layout[name]

    def shape(self) -> dict[str, int]:
        return dict(zip(self.layout.mesh_dim_names, self.layout.shape))


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    world_size: int
    fsdp_single_device: bool = False
    ep: int = 1

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
                raise UserError(
                    f"world size {world_size} is not divisible by the pipeline x replicate x context x "
                    f"tensor parallel degrees = {pp} x {replicate} x {cp} x {tp}"
                )
            shard = world_size // others
        if pp * replicate * shard * cp * tp != world_size:
            raise UserError(
                f"parallelism degrees multiply to {pp} x {replicate} x {shard} x {cp} x {tp} = "
                f"{pp * replicate * shard * cp * tp} (pipeline x replicate x shard x context x tensor) "
                f"but the world size is {world_size}"
            )
        ep = config.expert_parallel_degree
        if (shard * cp) % ep:
            raise UserError(
                f"expert_parallel_degree {ep} must divide data_parallel_shard_degree x "
                f"context_parallel_degree = {shard} x {cp} (expert parallelism is drawn from those ranks)"
            )
        return cls(pp, replicate, shard, cp, tp, world_size, config.fsdp_single_device, ep)

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
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def build_mesh(self, device_type: str) -> Meshes:
        names = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
        shape = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        layout = init_device_mesh(device_type, shape, mesh_dim_names=names)
        dp_cp = layout["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        fsdp = layout["dp_shard", "cp"]._flatten("dp_shard_cp")
        if self.dp_replicate > 1:  # HSDP: replicas outermost, each sharding over dp_shard x cp
            sizes = (self.dp_replicate, self.dp_shard * self.cp)
            fsdp = dp_cp._unflatten(0, sizes, ("hsdp_replicate", "hsdp_shard"))
        dp = layout["dp_replicate", "dp_shard"]._flatten("dp")
        groups = {"dp": dp, "dp_cp": dp_cp, "fsdp": fsdp}
        if self.ep_enabled:
            groups |= self._expert_meshes(device_type)
        return Meshes(layout, groups)

    def _expert_meshes(self, device_type: str) -> dict[str, DeviceMesh]:
        """The experts' own layout of the same ranks (rank numbering as in the main mesh, with
        dp_shard x cp read as efsdp x ep)."""
        efsdp = self.dp_shard * self.cp // self.ep
        names = ("pp", "dp_replicate", "efsdp", "ep", "tp")
        experts = init_device_mesh(device_type, (self.pp, self.dp_replicate, efsdp, self.ep, self.tp),
                                   mesh_dim_names=names)  # fmt: skip
        fsdp = experts["dp_replicate", "efsdp"] if self.dp_replicate > 1 else experts["efsdp"]
        expert_tp = experts["ep", "tp"] if self.tp_enabled else experts["ep"]
        return {"ep": experts["ep"], "expert_tp": expert_tp, "expert_fsdp": fsdp}

    def check_sequence_split(self, seq_len: int) -> None:
        if self.cp_enabled and seq_len % (2 * self.cp):
            raise UserError(
                f"training.seq_len ({seq_len}) must divide into 2 x context_parallel_degree = "
                f"{2 * self.cp} chunks"
            )
        local = seq_len // self.cp
        if self.tp_enabled and local % self.tp:  # sequence parallelism splits a rank's tokens
            what = f"training.seq_len ({seq_len})"
            if self.cp_enabled:
                what = f"the {local} tokens per context-parallel rank (training.seq_len / {self.cp})"
            raise UserError(f"tensor_parallel_degree {self.tp} does not divide {what}")

    def check_divisibility(self, sizes: dict[str, int]) -> None:
        """Every named size (heads, vocabulary, sequence length...) must split evenly over tp."""
        for name, size in sizes.items():
            if size % self.tp:
                raise UserError(f"tensor_parallel_degree {self.tp} does not divide {name} ({size})")

    def describe(self) -> str:
        experts = f" (experts: ep {self.ep} of dp_shard x cp)" if self.ep_enabled else ""
        return (
            f"world {self.world_size} = pp {self.pp} x dp_replicate {self.dp_replicate} x dp_shard "
            f"{self.dp_shard} x cp {self.cp} x tp {self.tp}{experts}"
        )
