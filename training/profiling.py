"""Profiler traces of chosen steps and ranks, and CUDA memory snapshots, under <dump_folder>/profiles.

    --profiling.enable --profiling.start_step 10 --profiling.steps 2 --profiling.ranks 0,3

writes profiles/rank0_step10-11.json.gz (open in https://ui.perfetto.dev or chrome://tracing) and
profiles/rank0_step10-11.txt (the ops that took the most device time). With memory_snapshot, the
CUDA allocator's history over those steps goes to profiles/rank0_memory.pickle (drag into
https://pytorch.org/memory_viz); it is also written if training runs out of CUDA memory.
"""

import logging
import pickle
from pathlib import Path

import torch

from configs.schema import Profiling

logger = logging.getLogger(__name__)
_recording: "StepProfiler | None" = None  # the profiler recording memory history, for save_after_oom


class StepProfiler:
    def __init__(self, config: Profiling, dump_folder: Path, rank: int, device: torch.device):
        self.config = config
        self.active = config.enable and rank in config.ranks
        self.folder = dump_folder / "profiles"
        self.prefix = f"rank{rank}"
        self.cuda = device.type == "cuda"
        self.profiler = None
        if self.active and config.memory_snapshot and self.cuda:
            global _recording
            torch.cuda.memory._record_memory_history(max_entries=200_000)
            _recording = self

    @property
    def last_step(self) -> int:
        return self.config.start_step + self.config.steps - 1

    def step_begins(self, step: int) -> None:
        if self.active and step == self.config.start_step:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self.profiler.__enter__()

    def step_ends(self, step: int) -> None:
        if self.profiler is None or step != self.last_step:
            return
        if self.cuda:
            torch.cuda.synchronize()
        self.profiler.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        name = f"{self.prefix}_step{self.config.start_step}-{step}"
        self.profiler.export_chrome_trace(str(self.folder / f"{name}.json.gz"))
        sort_by = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        table = self.profiler.key_averages().table(sort_by=sort_by, row_limit=40)
        (self.folder / f"{name}.txt").write_text(table + "\n")
        self.profiler = None
        logger.info(f"profile of steps {self.config.start_step}-{step} saved to {self.folder / name}.*")
        if self.config.memory_snapshot and self.cuda:
            self.save_memory_snapshot()

    def save_memory_snapshot(self) -> None:
        if not (self.active and self.config.memory_snapshot and self.cuda):
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{self.prefix}_memory.pickle"
        with path.open("wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)
        logger.info(f"CUDA memory snapshot saved to {path}")


def save_after_oom() -> None:
    """Called when training ran out of CUDA memory: keep the allocator history for diagnosis."""
    if _recording is not None:
        _recording.save_memory_snapshot()
