"""Loading: resume from the latest complete checkpoint of this run (any layout, any world size), or
start from given weights (checkpoint.initial_load_path: a checkpoint folder or a Hugging Face one).

Nothing read is used before the checkpoint is known to be whole and to fit: its .metadata must name
this model's tensors with this model's shapes, and its files must match the checksums recorded when
it was saved (checkpoint/integrity.py; .metadata before it is unpickled, the data files while DCP
reads them, one pass over the disk). Everything is read as data only (checkpoint/data_only.py).
Any problem stops every rank with one error line.
"""

import concurrent.futures
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from checkpoint import data_only, hf, integrity
from checkpoint.data_only import DataOnlyReader
from checkpoint.saving import complete_steps
from checkpoint.state import Checkpointed, load_model_state, model_state
from checkpoint.storage import describe, first_failure
from configs import UserError
from configs.errors import first_line
from configs.schema import Checkpoint
from parallelisms.wrapper_names import original_name

logger = logging.getLogger(__name__)


def latest_step(config: Checkpoint, folder: Path) -> tuple[int | None, str]:
    """The step to resume from (None: no checkpoint of this run) and, for an error message, how to
    resume from an earlier one. It only reads: what killed saves left behind is reported at the
    resume (checkpoint/saving.py report_leftovers)."""
    steps = complete_steps(folder) if config.enable else []
    if not steps:
        if config.load_step not in (-1, 0) and config.enable:
            raise UserError(f"checkpoint.load_step {config.load_step}: no checkpoints in {folder}")
        return None, ""
    step = steps[-1] if config.load_step == -1 else config.load_step
    if step not in steps:
        raise UserError(f"checkpoint.load_step {step}: no complete checkpoint step-{step} in {folder}")
    if (folder / f"step-{step}").is_symlink():  # (checkpoint/run_identity.py)
        path = folder / f"step-{step}"
        raise UserError(
            f"checkpoint {path} is a symbolic link (to {os.readlink(path)}), not a checkpoint of this run: "
            "it was not loaded; to continue from it copy the folder itself into a new job.dump_folder "
            "(which adopts its run), or start from its weights with checkpoint.initial_load_path"
        )
    earlier = [s for s in steps if s < step]
    hint = f"; to resume from an earlier one: --checkpoint.load_step {earlier[-1]}" if earlier else ""
    return step, hint


def set_aside_later(folder: Path, step: int) -> None:
    """After a resume from an earlier step (checkpoint.load_step) than the latest checkpoint, rank 0
    renames the later ones step-N.abandoned, so that the next resume continues this run,
    keep_latest_k never counts them, and this run's own saves of those steps replace nothing. One
    that cannot be renamed stops every rank before training: the next plain rerun would resume it."""
    failure = None
    later = [s for s in complete_steps(folder) if s > step] if dist.get_rank() == 0 else []
    for later_step in later:
        source = folder / f"step-{later_step}"
        target, n = folder / f"step-{later_step}.abandoned", 1
        while target.exists():  # (set aside before, by an earlier rollback)
            n += 1
            target = folder / f"step-{later_step}.abandoned-{n}"
        try:
            source.rename(target)
        except OSError as e:
            failure = (
                f"checkpoint.load_step {step}: the later checkpoint {source} could not be set aside "
                f"({describe(e)}), so a rerun would continue from it, not from this run; move it out of "
                f"{folder}, then run again"
            )
            break
        logger.warning(
            f"{source} renamed {target.name}: this run continues from step {step} (delete it to free space)"
        )
    verdict = [failure]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise UserError(verdict[0])


def resume(
    path: Path, checkpointed: Checkpointed, parts: list[str], reader: DataOnlyReader,
    allow_model_change: bool, hint: str,
) -> None:  # fmt: skip
    """Load the checkpoint at path into checkpointed's objects (its parts: model, optimizer, train,
    dataloader): checked against this model first, verified beside the read, used only if whole."""
    start = time.perf_counter()
    saved = read_metadata(path, hint)
    missing = [p for p in parts if not any(key.startswith(p + ".") for key in saved)]
    if missing:
        raise UserError(
            f"checkpoint {path} has no {', '.join(missing)} (a model-only save?); to start from its "
            f"weights use checkpoint.initial_load_path, or exclude_from_loading = {missing}"
        )
    check_shapes(
        path, saved, {f"model.{n}": tuple(t.shape) for n, t in model_state(checkpointed.model_parts).items()}
    )
    state = checkpointed.state(parts)
    if "optimizer" in parts:
        state["optimizer"] = optimizer_state_to_read(path, saved, state["optimizer"])
    if "dataloader" in parts:  # a data state written before a key existed (e.g. "data") lacks it
        state["dataloader"] = {k: v for k, v in state["dataloader"].items() if f"dataloader.{k}" in saved}
    prepared = time.perf_counter() - start
    # The checksums are checked while DCP reads the same files: one pass over the disk instead
    # of two (18 GB on the H200 machine: 10.1 s, against 14.0 s one after the other). A damaged
    # file stops every rank before anything read is used.
    manifest = _manifest(path)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        checking = pool.submit(_problems, path, manifest)
        failure = None
        try:
            dcp.load(state, storage_reader=reader)
        except (Exception, dcp.CheckpointException) as e:  # DCP's own is a BaseException
            failure = e
        read = time.perf_counter() - start - prepared
        problems, check_seconds = checking.result()
    refuse_damaged(path, manifest, problems, check_seconds, hint)
    if failure is not None:
        if refusal := data_only.not_data_in(failure):
            raise data_only.refused(path, refusal)
        why = read_failure(failure)
        raise UserError(f"checkpoint {path} could not be read: {why}; it was not used{hint}")
    if "train" in parts:  # before anything is loaded into the model
        checkpointed.train_state.check_model(state["train"]["model"], str(path), allow_model_change)
    try:
        checkpointed.load(state)
    except data_only.NotData as e:  # (a pickle inside a value: the RNG state)
        raise data_only.refused(path, e) from None
    timings = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in getattr(reader, "timings", {}).items())
    logger.info(
        f"resumed from {path} in {time.perf_counter() - start:.1f} s (step {checkpointed.train_state.step}; "
        f"loaded {', '.join(parts)}; state prepared in {prepared:.1f} s, files read in {read:.1f} s"
        f"{f' ({timings})' if timings else ''}, checked beside the read in {check_seconds:.1f} s)"
    )


def load_initial_weights(
    model_parts: list[nn.Module], adapter, path: Path, reader: Callable[[Path], DataOnlyReader]
) -> None:
    """Weights to start from: a checkpoint folder (step-N, verified first) or a Hugging Face folder."""
    if not path.exists():
        raise UserError(f"checkpoint.initial_load_path '{path}' does not exist")
    if hf.is_hf_folder(path):
        hf.load_into(model_parts, hf.require(adapter), path)
    elif not (path / ".metadata").is_file():
        raise UserError(_neither_weights_message(path))
    else:
        manifest = _manifest(path)
        refuse_damaged(path, manifest, *_problems(path, manifest), "")
        saved = read_metadata(path)
        # Starting weights are the parameters; a buffer the folder lacks (e.g. an MoE layer's
        # expert bias, which Hugging Face conversions do not carry) keeps its initial value.
        buffers = {original_name(n) for part in model_parts for n, _ in part.named_buffers()}
        state = {"model": {name: tensor for name, tensor in model_state(model_parts).items()
                           if name not in buffers or f"model.{name}" in saved}}  # fmt: skip
        check_shapes(path, saved, {f"model.{n}": tuple(t.shape) for n, t in state["model"].items()})
        try:
            dcp.load(state, storage_reader=reader(path), planner=DefaultLoadPlanner(allow_partial_load=True))
        except (Exception, dcp.CheckpointException) as e:
            if refusal := data_only.not_data_in(e):
                raise data_only.refused(path, refusal) from None
            raise UserError(f"checkpoint.initial_load_path {path} is unreadable: {read_failure(e)}") from None
        load_model_state(model_parts, state["model"], strict=False)
    logger.info(f"initial weights from {path}")


def read_failure(failure: BaseException) -> str:
    """What failed a dcp.load, in words: the file and the cause (DataOnlyReader names the file),
    from inside DCP's CheckpointException."""
    failure = first_failure(failure)
    if isinstance(failure, data_only.UnreadableFile):
        return str(failure)
    return f"{type(failure).__name__}: {first_line(failure)}"


def _manifest(path: Path) -> dict | None:
    manifest = integrity.read_manifest(path)
    if manifest is None and dist.get_rank() == 0:
        logger.warning(
            f"{path} has no {integrity.MANIFEST} (saved by an older version): its files are not "
            "checked for damage, nor that it is this run's"
        )
    return manifest


def _problems(path: Path, manifest: dict | None) -> tuple[list[str], float]:
    """This rank's share of the checksum check (each file once over the ranks, read in parallel;
    no collectives, so it may run beside DCP's): problems found, seconds taken."""
    start = time.perf_counter()
    if manifest is None:
        return [], 0.0
    mine = integrity.share(manifest, dist.get_rank(), dist.get_world_size())
    unlisted = integrity.unlisted(path, manifest) if dist.get_rank() == 0 else []
    return unlisted + integrity.problems(path, manifest, mine), time.perf_counter() - start


def refuse_damaged(path: Path, manifest: dict | None, mine: list[str], seconds: float, hint: str) -> None:
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


def read_metadata(path: Path, hint: str = "") -> dict:
    """What the checkpoint holds, by key: checked against its checksum first, read as data only.
    hint: how to resume from an earlier checkpoint, for the error line of a damaged one."""
    if not (path / ".metadata").is_file():
        raise UserError(f"{path} is not a complete DCP checkpoint (no .metadata)")
    return data_only.read_metadata(path, hint).state_dict_metadata


def optimizer_state_to_read(path: Path, saved: dict, ours: dict) -> dict:
    """The part of this run's optimizer state (DCP's flat keys) to read from the checkpoint: every
    state tensor, which must be there (another optimizer's state is refused), and the parameter
    groups' settings the checkpoint has (they are this run's config's again after loading,
    checkpoint/state.py, so a setting an optimizer gained since is no reason to refuse)."""
    needed = [key for key in ours if key.startswith("state.")]
    missing = [key for key in needed if f"optimizer.{key}" not in saved]
    if missing:
        name = missing[0][len("state.") :].rsplit(".", 1)[0]  # a parameter whose state differs
        there = [key[len("optimizer.") :] for key in saved if key.startswith("optimizer.")]
        kept = lambda keys: ", ".join(
            sorted(k.rsplit(".", 1)[-1] for k in keys if k.startswith(f"state.{name}."))
        )
        raise UserError(
            f"checkpoint {path} holds another optimizer's state ({name}: {kept(there) or 'none'} there, "
            f"{kept(needed)} here); to change the optimizer on resume set "
            'checkpoint.exclude_from_loading = ["optimizer"] (its state then starts anew)'
        )
    return {
        key: value for key, value in ours.items() if key.startswith("state.") or f"optimizer.{key}" in saved
    }


def check_shapes(path: Path, saved: dict, ours: dict[str, tuple]) -> None:
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
