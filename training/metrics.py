"""Progress line, metrics.jsonl, TensorBoard and W&B: throughput, MFU, memory and ETA per logged step.

metrics.jsonl holds one training record per logged step, in step order, and after it that step's
validation record if any: a resumed run first drops the records of the steps it redoes (logged
after its checkpoint, before the run stopped), and TensorBoard drops their events (purge_step).
W&B gets TensorBoard's scalars (training/wandb_writer.py).

tps is tokens per second per device (global tokens / time / world size), as torchtitan reports it.
TFLOP/s per device = tps x flops_per_token, where flops_per_token is the model's own count
(6 x matmul parameters + causal attention, see the model's flops_per_token). MFU divides that by
the device's peak dense bf16 rate.
"""

import contextlib
import json
import logging
import os
import resource
import time
from pathlib import Path

import torch

from training.wandb_writer import WandbWriter

logger = logging.getLogger(__name__)

# Peak dense bf16 TFLOP/s (no sparsity) from the vendors' datasheets; the first key that the GPU's
# name contains wins, so a more specific name comes first.
PEAK_BF16_TFLOPS = [
    ("H100 PCIe", 756.0),
    ("H100", 989.4),  # SXM
    ("H200", 989.4),
    ("H800", 989.4),
    ("A100", 312.0),
    ("A800", 312.0),
    ("GB200", 2500.0),  # before B200, which its name contains
    ("B200", 2250.0),
]


def peak_tflops(device: torch.device, override: float) -> float | None:
    if override > 0:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = lookup_peak_tflops(name)
    if peak is None:
        logger.warning(f"no peak TFLOP/s known for '{name}': set metrics.peak_tflops for MFU")
    return peak


def lookup_peak_tflops(device_name: str) -> float | None:
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in device_name:
            return tflops
    return None


def _memory_gib(device: torch.device) -> float:
    """Peak memory since the last call: CUDA memory reserved by the allocator, else process RSS."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class MetricsLogger:
    """Collects per-step timings; every log_freq steps prints a line and appends to metrics.jsonl."""

    def __init__(
        self,
        dump_folder: str,
        device: torch.device,
        tokens_per_step: int,
        world_size: int,
        flops_per_token: float,
        total_steps: int,
        peak: float | None,
        log_freq: int,
        write: bool,
        enable_tensorboard: bool,
        resumed_step: int | None = 0,
        wandb: WandbWriter | None = None,
    ):
        """resumed_step: the step of the checkpoint this run resumed from (0 for a new run); the
        records of later steps, logged by an earlier run in this folder, are dropped (None: kept, for
        a fault-tolerant replica group, which continues its records after a restart). wandb: rank 0's
        W&B run (training/wandb_writer.py), sent the scalars TensorBoard gets."""
        self.device = device
        self.tokens_per_step = tokens_per_step
        self.world_size = world_size
        self.flops_per_token = flops_per_token
        self.total_steps = total_steps
        self.peak = peak
        self.log_freq = log_freq
        self.write = write  # only one rank writes files
        self.jsonl = Path(dump_folder) / "metrics.jsonl"
        if write and resumed_step is not None:
            self._drop_records_after(resumed_step)
        self.tensorboard = None
        if write and enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # TensorBoard hides the events of steps >= purge_step written before this point.
            purge = None if resumed_step is None else resumed_step + 1
            self.tensorboard = SummaryWriter(str(Path(dump_folder) / "tb"), purge_step=purge)
        self.wandb = wandb
        # On a CPU TFLOP/s round to 0.0 and no peak is known for MFU: the progress line leaves both out.
        self.show_flops = device.type != "cpu" or bool(peak)
        if not self.show_flops:
            logger.info("on CPU the progress line leaves out tflops and mfu (metrics.jsonl keeps them)")
        self.last_time = time.perf_counter()
        self.last_step = 0
        self.paused_seconds = 0.0  # in the current window, not training (validation, saves)

    def _drop_records_after(self, resumed_step: int) -> None:
        """Keep the records up to resumed_step, the file replaced in one rename (a kill leaves the old
        or the new one, never half of it). Also repairs files written before this existed: a training
        record replaces whatever an earlier run logged at its step or later."""
        if not self.jsonl.is_file():
            return
        lines = self.jsonl.read_text().splitlines()
        records: list[tuple[int, str]] = []
        for line in lines:
            try:
                record = json.loads(line)
                step = int(record["step"])
            except (ValueError, KeyError, TypeError):
                continue  # the last line of a run killed while writing it
            while "loss" in record and records and records[-1][0] >= step:
                records.pop()
            records.append((step, line))
        kept = [line for step, line in records if step <= resumed_step]
        dropped = len(lines) - len(kept)
        if dropped:
            temporary = self.jsonl.with_name(self.jsonl.name + ".tmp")
            temporary.write_text("".join(line + "\n" for line in kept))
            os.replace(temporary, self.jsonl)
        if resumed_step or dropped:
            note = f" ({dropped} records of later or redone steps dropped)" if dropped else ""
            logger.info(f"metrics.jsonl continues after step {resumed_step}{note}")

    def start(self, step: int) -> None:
        """Start the clock: training runs from here, after set-up, from step + 1."""
        self.last_time, self.last_step, self.paused_seconds = time.perf_counter(), step, 0.0

    def first_step_done(self, step: int, start_time: float) -> None:
        """Log how long start-up, initialization and the first step (with any compilation) took."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info(f"step {step} done {time.time() - start_time:.1f} s after start")

    def due(self, step: int) -> bool:
        return step % self.log_freq == 0 or step == self.total_steps

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside is not training time: tok/s, MFU and ETA leave it out."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.paused_seconds += time.perf_counter() - start

    def log(self, step: int, loss: float, grad_norm: float, lr: float, extra: dict | None = None) -> dict:
        now = time.perf_counter()
        step_time = (now - self.last_time - self.paused_seconds) / max(step - self.last_step, 1)
        tps = self.tokens_per_step / step_time / self.world_size
        tflops = tps * self.flops_per_token / 1e12
        record = {
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tps": round(tps, 1),
            "tflops": round(tflops, 3),
            "mfu": round(100 * tflops / self.peak, 2) if self.peak else None,
            "memory_gib": round(_memory_gib(self.device), 3),
            **(extra or {}),
        }
        eta = _duration(step_time * (self.total_steps - step))
        flops = f" | tflops {tflops:.1f}" if self.show_flops else ""
        mfu = f" | mfu {record['mfu']:.1f}%" if record["mfu"] is not None else ""  # none: no known peak
        experts = f" | moe max load {record['moe_max_load']:.2f}" if "moe_max_load" in record else ""
        logger.info(
            f"step {step:>{len(str(self.total_steps))}} | loss {loss:.4f} | grad_norm {grad_norm:.3f} | "
            f"lr {lr:.2e} | tok/s {tps:,.0f}{flops}{mfu} | mem {record['memory_gib']:.2f} GiB | "
            f"eta {eta}{experts}"
        )
        self._write(record)
        self.start(step)
        return record

    def log_validation(self, step: int, results: dict[str, float]) -> None:
        """A validation record of its own (step, val_loss, val_perplexity), logged after the
        training record of the same step."""
        logger.info(
            f"step {step:>{len(str(self.total_steps))}} | validation loss {results['val_loss']:.4f} | "
            f"perplexity {results['val_perplexity']:.2f}"
        )
        self._write({"step": step, **results})

    def _write(self, record: dict) -> None:
        if not self.write:
            return
        with self.jsonl.open("a") as f:
            f.write(json.dumps(record) + "\n")
        numbers = lambda value: isinstance(value, (int, float))
        scalars = {key: value for key, value in record.items() if key != "step" and numbers(value)}
        read = record.get("source_samples", {})
        total = max(sum(read.values()), 1)
        for name, samples in read.items():  # each source's share of the samples read so far
            scalars[f"data_share/{name}"] = samples / total
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, record["step"])
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.add_scalars(scalars, record["step"])

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.close()
