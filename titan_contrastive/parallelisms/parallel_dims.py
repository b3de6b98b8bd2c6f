"""Data-parallel layout: replicate x shard degrees, validated against WORLD_SIZE, one DeviceMesh,
and the batch arithmetic over it (global batch = local batch x accumulation steps x DP degree).

replicate only -> DDP; shard only -> FSDP2; both -> HSDP (FSDP2 on a 2-D mesh: shard inside a
group, replicate across groups); one process: no wrapper, or FSDP2 over its device for its mixed
precision (`fsdp_one_device`). Every rank is a data-parallel rank (no tensor/pipeline
parallelism), so the DP group is the whole world.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan_contrastive.config import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    world_size: int
    fsdp_one_device: bool = False  # FSDP2 over a single device (parallelism.fsdp_one_device at WORLD_SIZE=1)

    @classmethod
    def for_run(cls, parallelism: Any, world_size: int) -> ParallelDims:
        """`from_config` with the degrees of `[parallelism]` (a config.job_config.Parallelism)."""
        dims = cls.from_config(
            parallelism.data_parallel_replicate_degree, parallelism.data_parallel_shard_degree, world_size
        )
        return dataclasses.replace(dims, fsdp_one_device=world_size == 1 and parallelism.fsdp_one_device)

    @classmethod
    def from_config(cls, replicate: int, shard: int, world_size: int) -> ParallelDims:
        """Resolve the -1 ("fill the rest") degrees; replicate x shard must be WORLD_SIZE."""
        if replicate == -1 and shard == -1:
            raise ConfigError(
                "parallelism.data_parallel_replicate_degree and data_parallel_shard_degree are both -1; "
                "set at most one of them to -1"
            )
        if replicate == -1:
            replicate = world_size // shard if world_size % shard == 0 else -1
        if shard == -1:
            shard = world_size // replicate if world_size % replicate == 0 else -1
        if replicate < 1 or shard < 1 or replicate * shard != world_size:
            raise ConfigError(
                f"parallelism: data_parallel_replicate_degree ({replicate}) x data_parallel_shard_degree ({shard}) "
                f"must equal WORLD_SIZE={world_size}; use degrees whose product is {world_size} or -1 for one of them"
            )
        return cls(replicate, shard, world_size)

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1 or self.fsdp_one_device

    @property
    def ddp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard == 1

    @property
    def mode(self) -> str:
        if self.fsdp_enabled:
            return "hsdp" if self.dp_replicate > 1 else "fsdp"
        return "ddp" if self.ddp_enabled else "single"

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The (dp_replicate, dp_shard) mesh; None on a single process without FSDP. Build it once per run."""
        if self.world_size == 1 and not self.fsdp_one_device:
            return None
        return init_device_mesh(
            device_type, (self.dp_replicate, self.dp_shard), mesh_dim_names=("dp_replicate", "dp_shard")
        )


def gradient_accumulation_steps(global_batch_size: int, local_batch_size: int, dp_degree: int) -> int:
    """global // (local x dp); -1 means one microbatch per step. Non-multiples are an error
    that names the three numbers and the nearest valid global batch sizes."""
    per_microstep = local_batch_size * dp_degree
    if global_batch_size == -1:
        return 1
    if global_batch_size % per_microstep != 0 or global_batch_size < per_microstep:
        below = max(per_microstep, global_batch_size // per_microstep * per_microstep)
        above = (global_batch_size // per_microstep + 1) * per_microstep
        raise ConfigError(
            f"training.global_batch_size={global_batch_size} is not a multiple of local_batch_size "
            f"({local_batch_size}) x dp_degree ({dp_degree}) = {per_microstep}; nearest valid global batch "
            f"sizes: {' or '.join(map(str, sorted({below, above})))}"
        )
    return global_batch_size // per_microstep
