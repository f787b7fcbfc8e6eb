"""Saving and resuming: DCP checkpoints that appear only when complete, load into any layout.

Layout on disk, under <dump_folder>/<checkpoint.folder>:
    step-500/          a complete checkpoint (DCP files + .metadata)
    step-1000.partial/ a save in progress (or killed): never loaded, never counted
    step-100.deleting/ an old checkpoint being deleted (keep_latest_k), in the background
A save is written to step-N.partial and renamed to step-N by rank 0 once every rank has finished
(DCP writes .metadata last, after all ranks' data) and checksums.json records every file's checksum
(checkpoint/integrity.py), verified before anything loaded is used. Re-running the same command resumes
from the latest complete checkpoint; without one, checkpoint.initial_load_path gives starting weights.
"""

import concurrent.futures
import logging
import os
import re
import shutil
import threading
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from checkpoint import hf, integrity
from checkpoint.data_files import ParallelReader
from checkpoint.staging import Stager
from checkpoint.state import TrainState, load_model_state, load_optimizer_state, model_state, optimizer_state
from checkpoint.writer_process import WriterProcess, describe_staged
from checkpoint.writing import describe, write_files
from configs import UserError
from configs.errors import first_line
from configs.schema import Checkpoint
from training.weight_init import original_name

logger = logging.getLogger(__name__)
STEP_FOLDER = re.compile(r"^step-(\d+)$")
PARTS = ("model", "optimizer", "train", "dataloader")


def _fsync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def complete_steps(folder: Path) -> list[int]:
    """Steps of the complete checkpoints in folder, oldest first."""
    if not folder.is_dir():
        return []
    steps = []
    for path in folder.iterdir():
        match = STEP_FOLDER.match(path.name)
        if match and (path / ".metadata").is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


class Checkpointer:
    def __init__(
        self,
        config: Checkpoint,
        dump_folder: Path,
        model_parts: list[nn.Module],
        optimizers,
        dataloader,
        train_state: TrainState,
        adapter,
        total_steps: int,
    ):
        self.config = config
        self.folder = dump_folder / config.folder
        self.model_parts = model_parts
        self.optimizers = optimizers
        self.dataloader = dataloader  # anything with state_dict() / load_state_dict()
        self.train_state = train_state
        self.adapter = adapter
        self.total_steps = total_steps
        self.rank = dist.get_rank()
        self.is_rank0 = self.rank == 0
        self.pending: concurrent.futures.Future | None = None  # the async save in flight
        self.checksum_seconds = 0.0
        self.background = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        # Host copies of the state, refilled by every save: async saves write them in the background;
        # on a GPU blocking saves write them too (into page-locked buffers the copy runs at ~50 GB/s;
        # DCP's own copies into fresh pageable memory ran at ~1.5 GB/s on the H200, slower than the disk).
        self.stager = None
        # Async saves run collectives from a background thread: give them their own group.
        self.group = dist.new_group(backend="gloo") if config.async_mode != "disabled" else None
        self.writer: WriterProcess | None = None  # async saves' writer (checkpoint/writer_process.py)
        if config.enable and (config.async_mode != "disabled" or torch.cuda.is_available()):
            pinned = config.async_mode != "async"
            in_process = config.async_mode != "disabled" and config.async_writer == "process"
            in_process = in_process and hasattr(os, "memfd_create")  # (Linux; elsewhere a thread)
            if in_process:
                prefix = [f"checkpoint-writers-{uuid.uuid4().hex}/"]  # rank 0's, for the writers' group
                dist.broadcast_object_list(prefix, src=0, group=self.group)
                self.writer = WriterProcess(self.rank, dist.get_world_size(), prefix[0])
            self.stager = Stager(pinned, in_process, optimizers.parts, self._state, self._attach_writer)
        self.deleting: threading.Thread | None = None  # deleting checkpoints beyond keep_latest_k
        if not config.enable and self.is_rank0:
            _warn_about_unused_saving_keys(config)

    def _attach_writer(self, stager: Stager) -> None:
        if self.writer is None:
            return
        # No save may run meanwhile: it uses the same group and talks to the writer. (None does: the
        # buffers are made at the first update, or, when every update so far was skipped as
        # non-finite, inside the first save's optimizer_state(), whose DCP call runs a zero step,
        # before that save starts. The wait keeps this true if either changes.)
        self.wait()
        # The ranks' writers save together (one group): either every rank has shared buffers and
        # writes from its process, or every rank writes from a thread. (A rank whose shared memory
        # was refused, alone in a thread, would leave the others' writers waiting for its own.)
        everywhere = torch.tensor([int(stager.arena is not None)])
        dist.all_reduce(everywhere, op=dist.ReduceOp.MIN, group=self.group)
        if everywhere.item():
            self.writer.attach(stager.arena.fd)
        else:  # no shared buffers after all, here or on another rank: write from a thread
            self.writer.close()
            self.writer = None

    # ---- what is saved -------------------------------------------------------------------
    def _state(self, parts=PARTS) -> dict:
        state = {}
        if "model" in parts:
            state["model"] = model_state(self.model_parts)
        if "optimizer" in parts:
            state["optimizer"] = optimizer_state(self.model_parts, self.optimizers.parts)
        if "train" in parts:
            state["train"] = self.train_state.to_dict()
        if "dataloader" in parts:
            state["dataloader"] = self.dataloader.state_dict()
        return state

    # ---- saving ----------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.config.enable

    def due(self, step: int) -> bool:
        return self.config.enable and (step % self.config.interval == 0 or step == self.total_steps)

    def path(self, step: int) -> Path:
        """Where checkpoint step-<step> is once complete."""
        return self.folder / f"step-{step}"

    def save(self, step: int, blocking: bool = False) -> Path:
        """Write checkpoint step-<step>; returns its final path (complete once committed). A save that
        fails (disk full, folder gone, any write error) stops the run with a UserError on every rank:
        its partial folder is removed and the previous complete checkpoint is untouched."""
        start = time.perf_counter()  # (training is blocked from here until this returns)
        self.wait()  # one save in flight at a time
        final = self.path(step)
        partial = self.folder / f"step-{step}.partial"
        error = None
        if self.is_rank0:
            try:
                if partial.exists():
                    shutil.rmtree(partial)  # left by a save of this step that was killed
                partial.mkdir(parents=True)
            except OSError as e:
                error = describe(e)
        self._agree(partial, final, error)
        model_only = self.config.last_save_model_only and step == self.total_steps
        state = self._state(("model",) if model_only else PARTS)
        if model_only:
            dtype = getattr(torch, self.config.export_dtype)
            state["model"] = {name: tensor.to(dtype) for name, tensor in state["model"].items()}
        if self.config.async_mode == "disabled" or blocking or model_only:
            if self.stager is not None and not model_only:  # (a model-only save is a one-off)
                state = self.stager.stage_now(state)
            own, self.checksum_seconds = write_files(state, partial, self.rank, *self._writing)
            self._finish(own, partial, final)
            size = sum(f.stat().st_size for f in final.iterdir()) / 1e9 if self.is_rank0 else 0
            logger.info(
                f"saved checkpoint {final} in {time.perf_counter() - start:.1f} s ({size:.1f} GB; "
                f"checksums {self.checksum_seconds:.1f} s of it)"
            )
        else:
            staged = self.stager.stage(state)
            # Written, checksummed and committed in the background, as soon as the write ends.
            self.pending = self.background.submit(self._save_in_background, staged, partial, final, start)
            writer = "writer process" if self.writer is not None else "writer thread"
            logger.info(
                f"saving checkpoint {final} in the background by the {writer} (training blocked "
                f"{time.perf_counter() - start:.1f} s)"
            )
        return final

    @property
    def _writing(self) -> tuple[int, bool]:
        return self.config.writer_threads, self.config.direct_io

    def _save_in_background(self, staged, partial: Path, final: Path, start: float) -> None:
        def write():
            state = staged.result() if isinstance(staged, concurrent.futures.Future) else staged
            if self.writer is not None:  # (the tensors made after the buffers, if any, sent by value)
                return self.writer.write(describe_staged(self.stager, state), partial, *self._writing)
            return write_files(state, partial, self.rank, *self._writing, process_group=self.group)

        try:
            own, self.checksum_seconds = write()
        except Exception as e:  # (every rank must reach _finish's collective, or the others wait there)
            own = f"{type(e).__name__}: {e}"
        try:
            self._finish(own, partial, final, self.group)
        except UserError as e:  # raised on every rank at the next save or at the end
            logger.warning(f"{e} (the run stops at its next save)")
            raise
        began = time.perf_counter() - start
        logger.info(f"saved checkpoint {final} (committed {began:.1f} s after it began)")

    def before_state_changes(self) -> None:
        """Something other than the optimizer is about to change the state in place (a torchft
        group healing from a peer, MoE's expert-bias update): the save's host copies still running
        are taken over first, as the optimizer step's pre-hook does (checkpoint/staging.py)."""
        if self.stager is not None:  # (no copies run on unless overlapped: then a no-op)
            self.stager.wait()

    def wait(self) -> None:
        """Wait for the background save, if any (it commits itself); raise what stopped it."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def close(self) -> None:
        """At the end of training: the background save and deletion finished."""
        try:
            self.wait()
        finally:
            self.background.shutdown()
            self._wait_for_deletion()
            if self.writer is not None:
                self.writer.close()

    def _finish(self, own: dict | str, partial: Path, final: Path, group=None) -> None:
        """Every rank has written its files (own: their checksums) or failed (own: why). Rank 0
        writes checksums.json (every rank's files and .metadata) and renames the folder complete."""
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, own, group=group)
        error = next((e for e in everyone if isinstance(e, str)), None)
        if self.is_rank0 and error is None:
            try:
                files = {name: entry for part in everyone for name, entry in part.items()}
                # .metadata, and any data file named unlike DCP names them today (a later torch).
                others = [p for p in sorted(partial.glob("*.distcp")) if p.name not in files]
                files.update(integrity.checksum([*others, partial / ".metadata"]))
                integrity.write_manifest(partial, files)
                if final.exists():  # an older save of the same step (e.g. the run was restarted)
                    shutil.rmtree(final)
                _fsync_folder(partial)  # (its files' names on the disk before it is complete)
                partial.rename(final)
                _fsync_folder(self.folder)  # (the rename too, before older checkpoints are deleted)
            except OSError as e:
                error = describe(e)
        self._agree(partial, final, error, group)
        if self.is_rank0:
            self._delete_old_in_background()

    def _agree(self, partial: Path, final: Path, error: str | None, group=None) -> None:
        """Every rank learns rank 0's verdict; on an error every rank raises the same UserError,
        after rank 0 removed the partial folder (the previous checkpoints stay as they are)."""
        verdict = [error]
        dist.broadcast_object_list(verdict, src=0, group=group)
        if verdict[0] is None:
            return
        if self.is_rank0:
            shutil.rmtree(partial, ignore_errors=True)
        latest = complete_steps(self.folder)
        kept = f"{self.path(latest[-1])} is the latest complete one" if latest else "no other is complete"
        raise UserError(f"checkpoint {final} could not be saved: {verdict[0]}; {kept}")

    def _delete_old_in_background(self) -> None:
        """keep_latest_k: delete older complete checkpoints off the critical path (a large
        checkpoint takes seconds to delete, and every rank would wait for rank 0 at its next
        collective)."""
        self._wait_for_deletion()
        keep = self.config.keep_latest_k
        old = complete_steps(self.folder)[:-keep] if keep > 0 else []
        doomed = []
        for step in old:  # renamed first, so that a kill mid-deletion leaves no half checkpoint
            try:
                doomed.append(self.path(step).rename(self.folder / f"step-{step}.deleting"))
            except OSError as e:  # (rank 0 only, after the ranks agreed: not a reason to stop)
                logger.warning(f"keep_latest_k: {self.path(step)} could not be deleted: {describe(e)}")
        if doomed:
            self.deleting = threading.Thread(
                target=lambda: [shutil.rmtree(p, ignore_errors=True) for p in doomed]
            )
            self.deleting.start()

    def _set_aside(self, later: list[int], step: int) -> None:
        """A run resumed from an earlier step (checkpoint.load_step) than the latest checkpoint:
        the later ones are renamed step-N.abandoned, so that the next resume continues this run,
        keep_latest_k never counts them, and this run's own saves of those steps replace nothing."""
        for later_step in later:
            target, n = self.folder / f"step-{later_step}.abandoned", 1
            while target.exists():  # (set aside before, by an earlier rollback)
                n += 1
                target = self.folder / f"step-{later_step}.abandoned-{n}"
            try:
                self.path(later_step).rename(target)
            except OSError as e:
                logger.warning(f"{self.path(later_step)} could not be set aside: {describe(e)}")
                continue
            logger.warning(
                f"{self.path(later_step)} renamed {target.name}: this run continues from step {step} "
                "(delete it to free space)"
            )

    def _wait_for_deletion(self) -> None:
        if self.deleting is not None:
            self.deleting.join()
            self.deleting = None

    # ---- loading ---------------------------------------------------------------------------
    def load(self) -> bool:
        """Resume from a checkpoint of this run, or load initial weights; True if resumed."""
        steps = complete_steps(self.folder) if self.config.enable else []
        if self.config.enable and self.is_rank0:
            for stale in sorted(self.folder.glob("step-*.partial")):
                logger.warning(f"ignoring {stale}: a save that did not finish (delete it to free space)")
            for doomed in self.folder.glob("step-*.deleting"):  # a deletion that was killed
                shutil.rmtree(doomed, ignore_errors=True)
        if steps:
            step = steps[-1] if self.config.load_step == -1 else self.config.load_step
            if step not in steps:
                raise UserError(
                    f"checkpoint.load_step {step}: no complete checkpoint step-{step} in {self.folder}"
                )
            earlier = [s for s in steps if s < step]
            hint = f"; to resume from an earlier one: --checkpoint.load_step {earlier[-1]}" if earlier else ""
            self._load_checkpoint(self.folder / f"step-{step}", hint)
            if self.is_rank0:
                self._set_aside([s for s in steps if s > step], step)
            return True
        if self.config.load_step not in (-1, 0) and self.config.enable:
            raise UserError(f"checkpoint.load_step {self.config.load_step}: no checkpoints in {self.folder}")
        if self.config.initial_load_path:
            self._load_initial_weights(Path(self.config.initial_load_path))
        return False

    def _load_checkpoint(self, path: Path, hint: str) -> None:
        start = time.perf_counter()
        parts = [p for p in PARTS if p not in self.config.exclude_from_loading]
        saved = _read_metadata(path)
        self._check_compatible(path, saved, parts)
        state = self._state(parts)
        prepared = time.perf_counter() - start
        # The checksums are checked while DCP reads the same files: one pass over the disk instead
        # of two (18 GB on the H200 machine: 10.1 s, against 14.0 s one after the other). A damaged
        # file stops every rank before anything read is used.
        manifest = self._manifest(path)
        reader = ParallelReader(path, self.config.writer_threads)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            checking = pool.submit(self._problems, path, manifest)
            failure = None
            try:
                dcp.load(state, storage_reader=reader)
            except (Exception, dcp.CheckpointException) as e:  # DCP's own is a BaseException
                failure = e
            read = time.perf_counter() - start - prepared
            problems, check_seconds = checking.result()
        self._refuse_damaged(path, manifest, problems, check_seconds, hint)
        if failure is not None:
            raise UserError(
                f"checkpoint {path} could not be read ({type(failure).__name__}: {first_line(failure)})"
            )
        if "train" in parts:  # before anything is loaded into the model
            self.train_state.check_model(state["train"]["model"], str(path), self.config.allow_model_change)
        if "model" in parts:
            load_model_state(self.model_parts, state["model"])
        if "optimizer" in parts:
            load_optimizer_state(self.model_parts, self.optimizers.parts, state["optimizer"])
        if "train" in parts:
            self.train_state.load_dict(state["train"])
        if "dataloader" in parts:
            self.dataloader.load_state_dict(state["dataloader"])
        parts_read = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in reader.timings.items())
        logger.info(
            f"resumed from {path} in {time.perf_counter() - start:.1f} s (step {self.train_state.step}; "
            f"loaded {', '.join(parts)}; state prepared in {prepared:.1f} s, files read in {read:.1f} s "
            f"({parts_read}), checked beside the read in {check_seconds:.1f} s)"
        )

    def _verify(self, path: Path, hint: str = "") -> None:
        """Refuse a checkpoint whose files changed after they were saved, before reading it."""
        manifest = self._manifest(path)
        self._refuse_damaged(path, manifest, *self._problems(path, manifest), hint)

    def _manifest(self, path: Path) -> dict | None:
        manifest = integrity.read_manifest(path)
        if manifest is None and self.is_rank0:
            logger.warning(
                f"{path} has no {integrity.MANIFEST} (saved by an older version): its files are not "
                "checked for damage"
            )
        return manifest

    def _problems(self, path: Path, manifest: dict | None) -> tuple[list[str], float]:
        """This rank's share of the checksum check (each file once over the ranks, read in
        parallel; no collectives, so it may run beside DCP's): problems found, seconds taken."""
        start = time.perf_counter()
        if manifest is None:
            return [], 0.0
        mine = integrity.share(manifest, self.rank, dist.get_world_size())
        return integrity.problems(path, manifest, mine), time.perf_counter() - start

    def _refuse_damaged(
        self, path: Path, manifest: dict | None, mine: list[str], seconds: float, hint: str
    ) -> None:
        """The ranks agree on the problems found, so that every rank stops or none does."""
        if manifest is None:
            return
        everyone: list[list[str]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, mine)
        found = [problem for part in everyone for problem in part]
        if found:
            more = f" (and {len(found) - 1} more files)" if len(found) > 1 else ""
            raise UserError(f"checkpoint {path} is damaged: {found[0]}{more}; it was not used{hint}")
        logger.info(f"checked {path} against its checksums in {seconds:.1f} s")

    def _check_compatible(self, path: Path, saved: dict, parts: list[str]) -> None:
        """Refuse a checkpoint of another model, or one lacking what is to be loaded."""
        missing = [p for p in parts if not any(key.startswith(p + ".") for key in saved)]
        if missing:
            raise UserError(
                f"checkpoint {path} has no {', '.join(missing)} (a model-only save?); to start from its "
                f"weights use checkpoint.initial_load_path, or exclude_from_loading = {missing}"
            )
        ours = {f"model.{name}": tuple(t.shape) for name, t in model_state(self.model_parts).items()}
        _check_shapes(path, saved, ours)

    def _load_initial_weights(self, path: Path) -> None:
        if not path.exists():
            raise UserError(f"checkpoint.initial_load_path '{path}' does not exist")
        if hf.is_hf_folder(path):
            hf.load_into(self.model_parts, self.adapter, path)
        elif not (path / ".metadata").is_file():
            raise UserError(_neither_weights_message(path))
        else:
            self._verify(path)
            saved = _read_metadata(path)
            # Starting weights are the parameters; a buffer the folder lacks (e.g. an MoE layer's
            # expert bias, which Hugging Face conversions do not carry) keeps its initial value.
            buffers = {original_name(n) for part in self.model_parts for n, _ in part.named_buffers()}
            state = {"model": {name: tensor for name, tensor in model_state(self.model_parts).items()
                               if name not in buffers or f"model.{name}" in saved}}  # fmt: skip
            _check_shapes(path, saved, {f"model.{n}": tuple(t.shape) for n, t in state["model"].items()})
            try:
                dcp.load(
                    state,
                    storage_reader=ParallelReader(path, self.config.writer_threads),
                    planner=DefaultLoadPlanner(allow_partial_load=True),
                )
            except (Exception, dcp.CheckpointException) as e:
                raise UserError(
                    f"checkpoint.initial_load_path {path} is unreadable: {first_line(e)}"
                ) from None
            load_model_state(self.model_parts, state["model"], strict=False)
        logger.info(f"initial weights from {path}")


def _warn_about_unused_saving_keys(config: Checkpoint) -> None:
    """Saving keys set with saving off: a recipe may keep them so (resuming keys set without enable
    are errors, configs/schema.py), but a command line that sets one likely forgot enable."""
    defaults = Checkpoint()
    keys = ("folder", "interval", "keep_latest_k", "async_mode", "async_writer", "writer_threads",
            "direct_io", "last_save_model_only", "export_dtype")  # fmt: skip
    unused = [f"checkpoint.{key}" for key in keys if getattr(config, key) != getattr(defaults, key)]
    if unused:
        logger.warning(f"{', '.join(unused)} set, but checkpoint.enable is false: no checkpoint is saved")


def _neither_weights_message(path: Path) -> str:
    """initial_load_path names no weights; point at checkpoints inside it (a run's folder?)."""
    message = (
        f"checkpoint.initial_load_path '{path}' is neither a checkpoint (a step-N folder with .metadata) "
        "nor a Hugging Face folder (.safetensors files)"
    )
    for folder in (path, path / "checkpoint"):
        steps = complete_steps(folder)
        if steps:
            return f"{message}; it holds checkpoints: name one, e.g. {folder / f'step-{steps[-1]}'}"
    return message


def _read_metadata(path: Path) -> dict:
    if not (path / ".metadata").is_file():
        raise UserError(f"{path} is not a complete DCP checkpoint (no .metadata)")
    try:
        return FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as e:
        raise UserError(
            f"checkpoint {path} is corrupt: its .metadata cannot be read ({first_line(e)})"
        ) from None


def _check_shapes(path: Path, saved: dict, ours: dict[str, tuple]) -> None:
    problems = []
    for key, shape in ours.items():
        entry = saved.get(key)
        if entry is None:
            problems.append(f"{key[6:]} is missing")
        elif isinstance(entry, TensorStorageMetadata) and tuple(entry.size) != shape:
            problems.append(f"{key[6:]} is {tuple(entry.size)} there, {shape} here")
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        raise UserError(f"checkpoint {path} holds a different model: {shown}")
