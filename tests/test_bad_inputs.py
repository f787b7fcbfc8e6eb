"""The catalog of user mistakes: each stops train.py with one `error:` line naming the cause, exit
code 2, no traceback, and nothing deleted, changed or half-written.

Most cases run in one process through tests/catalog_runner.py (train.main() per command line, the
imports paid once); the ones that need several ranks run under torchrun.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TINY, run_train, write_mixture, write_token_source

from checkpoint import integrity
from parallelisms.compile import COMPILED_CHECKPOINT_FAILS_WITH_TP
from training import run_folder

BASE = [*TINY, "--training.steps", "2"]
RESUME = ["--checkpoint.enable", "--training.steps", "3"]  # root/run's step-2 is not the last step


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}  # fmt: skip


def run_catalog(cases: list[list[str]], folder: Path) -> list[dict]:
    (folder / "cases.json").write_text(json.dumps(cases))
    command = [sys.executable, str(REPO / "tests/catalog_runner.py"), str(folder / "cases.json"),
               str(folder / "results.json")]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    subprocess.run(command, check=True, capture_output=True, env={**env, "OMP_NUM_THREADS": "1"})
    return json.loads((folder / "results.json").read_text())


def write_bad_corpora(root: Path) -> None:
    """One folder per damaged corpus, named as the catalog's cases use them."""
    import pyarrow
    import pyarrow.parquet as pq

    good = json.dumps({"text": "a fine document"}) + "\n"
    corpora = {
        "random_bytes/data.jsonl": good.encode() + bytes(range(128, 256)) + b"\n",
        "truncated_line/data.jsonl": (good + good[:12]).encode(),
        "not_an_object/data.jsonl": (good + good + "[1, 2]\n").encode(),
        "null_text/data.jsonl": (good + json.dumps({"text": None}) + "\n").encode(),
        "number_text/data.jsonl": (json.dumps({"text": 7}) + "\n").encode(),
        "empty_parquet/data.parquet": b"",
        "csv_parquet/data.parquet": b"text\nnot parquet at all\n",
        "empty_txt/a.txt": b"",
        "empty_texts/data.jsonl": (json.dumps({"text": ""}) + "\n").encode() * 3,
    }
    for name, content in corpora.items():
        (root / name).parent.mkdir(parents=True)
        (root / name).write_bytes(content)
    (root / "null_parquet").mkdir()
    pq.write_table(pyarrow.table({"text": ["one", "two", None]}), root / "null_parquet" / "data.parquet")
    (root / "int_parquet").mkdir()
    pq.write_table(pyarrow.table({"text": [1, 2]}), root / "int_parquet" / "data.parquet")
    # A tokenizer whose vocabulary holds an id past its size: "e" is 5000 in a vocabulary of 266.
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(["hello world"] * 10, trainer)
    broken = json.loads(tokenizer.to_str())
    broken["model"]["vocab"]["e"] = 5000
    (root / "wide_ids").mkdir()
    (root / "wide_ids" / "tokenizer.json").write_text(json.dumps(broken))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Bad inputs on disk, a real checkpoint to damage, and a folder locked by this process (a run
    in it)."""
    root = tmp_path_factory.mktemp("inputs")
    (root / "bad.toml").write_text("[training\nsteps = 3\n")
    (root / "typo.toml").write_text("[trainig]\nsteps = 3\n")
    (root / "latin1.toml").write_bytes(b"[training]\nsteps = 3  # caf\xe9\n")
    (root / "empty").mkdir()
    (root / "empty" / "nothing.jsonl").write_text("")
    (root / "field").mkdir()
    (root / "field" / "docs.jsonl").write_text(json.dumps({"content": "text under another name"}) + "\n")
    write_bad_corpora(root)
    write_mixture(root / "mix", {"web": 4000, "code": 4000})
    write_mixture(root / "other", {"web": 4000})
    write_token_source(root / "wide", [1, 2, 3] * 1000, dtype="uint32")
    write_token_source(root / "foreign", [1, 2, 3] * 1000, tokenizer_id="sha256:" + "0" * 64)
    write_token_source(root / "vocab", [1, 2, 3] * 1000, vocab_size=32000)
    (root / "no_tokenizer").mkdir()
    (root / "no_meta").mkdir()
    (root / "a_file").write_text("not a folder")
    subprocess.run([sys.executable, str(REPO / "scripts/prepare_data.py"), "--dataset", "python_docs",
                    "--output", str(root / "shards")], check=True, capture_output=True)  # fmt: skip
    shard = root / "shards" / "tokens-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-100])
    run_train(
        [*BASE, "--checkpoint.enable", "--checkpoint.interval", "2", "--job.dump_folder", str(root / "run")]
    )
    (root / "in_the_way" / "checkpoint").mkdir(parents=True)
    (root / "in_the_way" / "checkpoint" / "step-2").write_text("not a checkpoint")
    (root / "checkpoint_file").mkdir()
    (root / "checkpoint_file" / "checkpoint").write_text("not a folder")
    for name in ("truncated", "flipped", "unverified", "bad_manifest", "other_model", "other_run", "unlisted",
                 "gone", "corrupt_metadata"):  # fmt: skip
        shutil.copytree(root / "run" / "checkpoint" / "step-2", root / name / "checkpoint" / "step-2")
    for name in ("truncated", "unverified"):
        data = root / name / "checkpoint" / "step-2" / "__0_0.distcp"
        data.write_bytes(data.read_bytes()[:1000])
    data = root / "flipped" / "checkpoint" / "step-2" / "__0_0.distcp"
    content = bytearray(data.read_bytes())  # 4 KiB flipped in place: the size stays
    content[8192:12288] = bytes(byte ^ 0xFF for byte in content[8192:12288])
    data.write_bytes(bytes(content))
    (root / "unverified" / "checkpoint" / "step-2" / "checksums.json").unlink()  # as older code saved
    (root / "bad_manifest" / "checkpoint" / "step-2" / "checksums.json").write_text('{"files": ')
    # Checkpoint identity (checkpoint/run_identity.py) and every file covered by checksums.json.
    (root / "linked" / "checkpoint").mkdir(parents=True)
    (root / "linked" / "checkpoint" / "step-2").symlink_to(root / "run" / "checkpoint" / "step-2")
    (root / "other_run" / "run_id").write_text("0123456789abcdef\n")  # this folder's run is another
    manifest = root / "unlisted" / "checkpoint" / "step-2" / "checksums.json"
    recorded = json.loads(manifest.read_text())
    del recorded["files"]["__0_1.distcp"]
    manifest.write_text(json.dumps(recorded))
    (root / "gone" / "checkpoint" / "step-2" / "__0_3.distcp").unlink()
    # A .metadata that cannot be unpickled (checksums recomputed), with an earlier step to go back to.
    corrupt = root / "corrupt_metadata" / "checkpoint"
    shutil.copytree(corrupt / "step-2", corrupt / "step-1")
    (corrupt / "step-2" / ".metadata").write_bytes(b"not a pickle")
    integrity.record(corrupt / "step-2")
    run_folder.lock(root / "locked")
    yield {"root": root}
    run_folder.release()


def cases(root: Path) -> list[tuple[str, list[str], str]]:
    """(name, command line, what the error line must say)."""
    return [
        ("section typo", ["--trainig.steps", "3"], "unknown option '--trainig.steps' (did you mean 'training.steps'?)"),
        ("key typo", ["--training.stepz", "3"], "unknown key 'training.stepz' (did you mean 'training.steps'?)"),
        ("not an integer", ["--training.steps", "ten"], "training.steps must be an integer, got 'ten'"),
        ("not a boolean", ["--metrics.enable_tensorboard", "maybe"], "must be true or false"),
        ("not a number", ["--optimizer.lr", "fast"], "optimizer.lr must be a number"),
        ("unknown choice", ["--training.device", "gpu"], "training.device must be one of 'auto', 'cuda', 'cpu'"),
        ("choice typo", ["--lr_scheduler.decay_type", "cosin"], "(did you mean 'cosine'?)"),
        ("zero steps", ["--training.steps", "0"], "training.steps must be >= 1 (got 0)"),
        ("negative batch", ["--training.local_batch_size=-4"], "training.local_batch_size must be >= 1"),
        ("zero seq_len", ["--training.seq_len", "0"], "training.seq_len must be >= 1"),
        ("negative lr", ["--optimizer.lr=-0.1"], "optimizer.lr must be a positive number"),
        ("decay ratio", ["--lr_scheduler.decay_ratio", "0"], "lr_scheduler.decay_ratio must be in (0, 1]"),
        ("batch split", ["--training.global_batch_size", "6"], "must be a multiple of local_batch_size"),
        ("missing config", ["--config", str(root / "missing.toml")], "does not exist"),
        ("broken toml", ["--config", str(root / "bad.toml")], "is not valid TOML"),
        ("toml section typo", ["--config", str(root / "typo.toml")], "unknown section [trainig]"),
        ("config not UTF-8", ["--config", str(root / "latin1.toml")], "latin1.toml is not a UTF-8 text file (byte 27 is 0xe9)"),
        ("model typo", ["--model.name", "lama3"], "model.name 'lama3' is not registered"),
        ("flavor", ["--model.flavor", "9B"], "model.flavor '9B' is not a llama3 flavor"),
        ("model args", ["--model.args", "n_layer=2"], "(did you mean 'n_layers'?)"),
        ("model dim", ["--model.args", "dim=100"], "dim 100 must be divisible by n_heads 8"),
        ("kv heads", ["--model.args", "n_kv_heads=3"], "n_heads 8 must be divisible by n_kv_heads 3"),
        ("odd head dim", ["--model.args", "dim=40"], "dim / n_heads = 5 must be even (RoPE)"),
        ("qwen3 head dim", ["--model.name", "qwen3", "--model.args", "head_dim=15"], "head_dim 15 must be even"),
        ("sequence too long", ["--training.seq_len", "33554432"], "more than this host's memory per process"),
        ("not a run folder", ["--job.dump_folder", str(root)], f"job.dump_folder '{root}' is not a run folder: it "
                                                               "holds a_file, bad.toml, bad_manifest and "),
        ("the root folder", ["--job.dump_folder", "/"], "job.dump_folder '/' is not a run folder: it holds "),
        ("a run in the folder", ["--job.dump_folder", str(root / "locked")],
         f"is in use by another run (pid {os.getpid()} on "),
        ("checkpoints outside", ["--checkpoint.enable", "--checkpoint.folder", "../elsewhere"],
         "checkpoint.folder '../elsewhere' must name a folder inside job.dump_folder"),
        ("checkpoints elsewhere", ["--checkpoint.enable", "--checkpoint.folder", str(root / "elsewhere")],
         "must name a folder inside job.dump_folder, e.g. \"checkpoint\" (not an absolute path"),
        ("a file where a checkpoint goes", ["--checkpoint.enable", "--checkpoint.interval", "2", "--job.dump_folder",
                                            str(root / "in_the_way")],
         "in_the_way/checkpoint/step-2 is a file where this run would save checkpoint step-2"),
        ("checkpoint folder is a file", ["--checkpoint.enable", "--job.dump_folder", str(root / "checkpoint_file")],
         "checkpoint_file/checkpoint cannot be made: "),
        ("fewer steps than the checkpoint's", ["--checkpoint.enable", "--training.steps", "1", "--job.dump_folder",
                                               str(root / "run")],
         "training.steps 1 is below the step of the checkpoint this run continues"),
        ("degrees vs world", ["--parallelism.tensor_parallel_degree", "2"], "world size 1 is not divisible by the "
                              "pipeline x replicate x context x tensor parallel degrees = 1 x 1 x 1 x 2"),
        ("zero bubble x FSDP", ["--job.dry_run", "--job.dry_run_world_size", "4", "--parallelism.pipeline_parallel_degree",
                                "2", "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"],
         "ZBVZeroBubble with FSDP gives wrong gradients"),
        ("TP vs seq_len", ["--job.dry_run", "--job.dry_run_world_size", "2", "--parallelism.tensor_parallel_degree", "2",
                           "--training.seq_len", "33"], "tensor_parallel_degree 2 does not divide training.seq_len (33)"),
        ("degrees product", ["--parallelism.data_parallel_shard_degree", "2"], "parallelism degrees multiply to"),
        ("zero degree", ["--parallelism.context_parallel_degree", "0"], "context_parallel_degree must be >= 1"),
        ("ac option", ["--activation_checkpoint.selective_ac_option", "x"], 'must be "op" or a positive'),
        ("exclude", ["--checkpoint.exclude_from_loading", "weights"], "may only name model, optimizer"),
        ("keep k", ["--checkpoint.keep_latest_k=-1"], "checkpoint.keep_latest_k must be >= 0"),
        ("writer threads", ["--checkpoint.writer_threads", "0"], "checkpoint.writer_threads must be >= 1"),
        ("replica groups", ["--fault_tolerance.enable"], "fault_tolerance.group_size must be >= 1 with enable"),
        ("replica id", ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2", "--fault_tolerance.replica_id",
                        "2"], "fault_tolerance.replica_id must be in 0 .. group_size - 1"),
        ("no lighthouse", ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"],
         "fault_tolerance needs the lighthouse's address"),
        ("min replicas", ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2",
                          "--fault_tolerance.min_replica_size", "3"], "fault_tolerance.min_replica_size must be in 1 .. group_size"),
        ("FT without torchrun", ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2",
                                 "--fault_tolerance.lighthouse", "http://localhost:1"], "fault_tolerance needs torchrun"),
        ("local SGD saves", ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2", "--fault_tolerance.semi_sync_method",
                             "local_sgd", "--fault_tolerance.sync_steps", "4", "--checkpoint.enable", "--checkpoint.interval",
                             "6"], "checkpoint.interval (6) must be a multiple of fault_tolerance.sync_steps (4)"),

        ("float8 recipe", ["--float8.enable", "--float8.recipe_name", "rowwise",
                           "--float8.enable_fsdp_float8_all_gather"], "works only with recipe_name = 'tensorwise'"),
        *([("compile x TP x AC by op", ["--job.dry_run", "--job.dry_run_world_size", "2",
                                        "--parallelism.tensor_parallel_degree", "2", "--compile.enable",
                                        "--activation_checkpoint.mode", "selective"],
            "compile with tensor parallelism and activation checkpointing by op")]
          if COMPILED_CHECKPOINT_FAILS_WITH_TP else []),  # torch < 2.14 only
        ("async TP without TP", ["--job.dry_run", "--parallelism.enable_async_tensor_parallel", "--compile.enable"],
         "parallelism.enable_async_tensor_parallel needs tensor_parallel_degree > 1"),
        ("async TP without compile", ["--job.dry_run", "--job.dry_run_world_size", "2", "--parallelism.tensor_parallel_degree",
                                      "2", "--parallelism.enable_async_tensor_parallel", "--compile.enable", "false"],
         "parallelism.enable_async_tensor_parallel needs compile.enable"),
        ("TP vs KV heads", ["--job.dry_run", "--job.dry_run_world_size", "2", "--parallelism.tensor_parallel_degree",
                            "2", "--model.args", "n_kv_heads=1"], "tensor_parallel_degree 2 does not divide model n_kv_heads (1)"),
        ("tied weights x PP", ["--job.dry_run", "--job.dry_run_world_size", "2", "--parallelism.pipeline_parallel_degree",
                               "2", "--model.args", "tie_embeddings=true"], "are one tied parameter but fall on different"),
        ("EP vs ranks", ["--job.dry_run", "--job.dry_run_world_size", "2", "--model.name", "qwen3_moe",
                         "--parallelism.expert_parallel_degree", "4"], "expert_parallel_degree 4 must divide"),
        ("EP vs experts", ["--job.dry_run", "--job.dry_run_world_size", "3", "--model.name", "qwen3_moe",
                           "--parallelism.expert_parallel_degree", "3"], "does not divide the 8 experts"),
        ("EP x checkpointing by op", ["--job.dry_run", "--job.dry_run_world_size", "2", "--model.name", "qwen3_moe",
                                      "--parallelism.expert_parallel_degree", "2", "--activation_checkpoint.mode",
                                      "selective"], "expert parallelism with activation_checkpoint selective_ac_option = 'op' fails"),
        ("CP x checkpointing by op", ["--job.dry_run", "--job.dry_run_world_size", "2", "--parallelism.context_parallel_degree",
                                      "2", "--activation_checkpoint.mode", "selective"], "context parallelism with activation_checkpoint"),
        ("EP on a dense model", ["--job.dry_run", "--job.dry_run_world_size", "2",
                                 "--parallelism.expert_parallel_degree", "2"], "needs a model with Mixture-of-Experts"),
        *[(f"deepseek_v3 {name}", ["--model.name", "deepseek_v3", *argv], expected) for name, argv, expected in [
            ("TP vs heads", ["--job.dry_run", "--job.dry_run_world_size", "3", "--parallelism.tensor_parallel_degree", "3",
                             "--training.seq_len", "36"],
             "tensor_parallel_degree 3 does not divide model n_heads (4)"),
            ("EP vs experts", ["--job.dry_run", "--job.dry_run_world_size", "3", "--parallelism.expert_parallel_degree", "3"],
             "expert_parallel_degree 3 does not divide the 8 experts"),
            ("dense blocks", ["--model.args", "first_k_dense=4"], "first_k_dense 4 must be between 0 and n_layers 3"),
            ("expert groups", ["--model.args", "n_expert_groups=3"], "n_experts 8 must be divisible by n_expert_groups 3"),
            ("group score", ["--model.args", "group_score=sum"], "group_score 'sum' is not one of top2_sum, max"),
            ("MTP depth", ["--model.args", "mtp_depth=-1"], "mtp_depth must be >= 0"),
            ("RoPE dims", ["--model.args", "qk_rope_head_dim=7"], "qk_rope_head_dim 7 must be even"),
            ("MTP block split off", ["--job.dry_run", "--job.dry_run_world_size", "2", "--parallelism.pipeline_parallel_degree",
                                     "2", "--parallelism.pipeline_parallel_split_points", "layers.3"],
             "pipeline_parallel_split_points: ['layers.3'] are not layers"),
        ]],
        *[(f"gpt_oss {name}", ["--model.name", "gpt_oss", *argv], expected) for name, argv, expected in [
            ("TP vs KV heads", ["--job.dry_run", "--job.dry_run_world_size", "4", "--parallelism.tensor_parallel_degree", "4"],
             "tensor_parallel_degree 4 does not divide model n_kv_heads (2)"),
            ("window", ["--model.args", "sliding_window=-1"], "sliding_window -1 must be >= 0"),
            ("expert activation", ["--model.args", "expert_activation=gelu"],
             "expert_activation 'gelu' is not one of swiglu, clamped_swiglu"),
        ]],
        ("MTP on a family without it", ["--model.args", "mtp_depth=1"], "'mtp_depth=1' is not name=value for a field of Llama3Args"),
        ("no data path", ["--training.dataset", "text"], "training.dataset_path is required"),
        ("missing data", ["--training.dataset", "text", "--training.dataset_path", str(root / "nowhere/*.jsonl")],
         "names no .txt, .jsonl or .parquet files"),
        ("empty data", ["--training.dataset", "text", "--training.dataset_path", str(root / "empty")],
         "the dataset has no documents"),
        ("text field", ["--training.dataset", "text", "--training.dataset_path", str(root / "field")],
         "has no field 'text'"),
        *[(f"corpus {name}", ["--training.dataset", "text", "--training.dataset_path", str(root / name)], expected)
          for name, expected in [
              ("random_bytes", "random_bytes/data.jsonl:2 is not a line of JSON"),
              ("truncated_line", "truncated_line/data.jsonl:2 is not a line of JSON"),
              ("not_an_object", "not_an_object/data.jsonl:3 is an array, not a JSON object"),
              ("null_text", "null_text/data.jsonl:2: field 'text' is null, not a string"),
              ("number_text", "number_text/data.jsonl:1: field 'text' is a number, not a string"),
              ("empty_parquet", "empty_parquet/data.parquet is not a Parquet file"),
              ("csv_parquet", "csv_parquet/data.parquet is not a Parquet file"),
              ("null_parquet", "null_parquet/data.parquet row group 0, row 2: 'text' is null"),
              ("int_parquet", "int_parquet/data.parquet: column 'text' holds int64, not text"),
              ("empty_txt", "the dataset has only empty documents, 1 of them"),
              ("empty_texts", "the dataset has only empty documents, 3 of them"),
          ]],
        ("tokenizer ids", ["--model.hf_assets_path", str(root / "wide_ids")], "gives token 'e' id 5000, beyond its vocabulary size 266"),
        ("tokenizer folder", ["--model.hf_assets_path", str(root / "missing_tokenizer")], "is not a folder"),
        ("no tokenizer.json", ["--model.hf_assets_path", str(root / "no_tokenizer")], "no tokenizer.json"),
        ("shards without meta", ["--training.dataset", "tokens", "--training.dataset_path", str(root / "no_meta")],
         "has no meta.json"),
        ("truncated shard", ["--training.dataset", "tokens", "--training.dataset_path", str(root / "shards")],
         "is missing or truncated"),
        *[(f"mixture: {name}", ["--training.dataset", "tokens", "--training.dataset_path",
                                ",".join(str(root / f) for f in folders), *extra], expected)
          for name, folders, extra, expected in [
              ("weights count", ["mix/web", "mix/code"], ["--training.dataset_weights", "1,2,3"],
               "training.dataset_weights has 3 weights for 2 sources"),
              ("negative weight", ["mix/web", "mix/code"], ["--training.dataset_weights", "1,-2"],
               "must be finite and >= 0"),
              ("zero weights", ["mix/web", "mix/code"], ["--training.dataset_weights", "0,0"], "are all zero"),
              ("missing folder", ["mix/web", "mix/nothing"], [], "mix/nothing' has no meta.json"),
              ("repeated name", ["mix/web", "other/web"], [], "names two sources 'web'"),
              ("mixed dtypes", ["mix/web", "wide"], [], "differ in dtype (uint16 and uint32)"),
              ("another tokenizer in the mix", ["mix/web", "foreign"], [], "differ in tokenizer"),
              ("another tokenizer", ["foreign"], [], "were made with another tokenizer"),
              ("another vocabulary", ["vocab"], [], "made with a tokenizer of 32000 tokens"),
          ]],
        ("weights for text", ["--training.dataset_weights", "1,2"], "mixes token-shard folders"),
        ("unwritable dump folder", ["--job.dump_folder", str(root / "a_file" / "run")], "cannot be written"),
        ("validation data", ["--validation.enable", "--validation.dataset", "text"],
         "validation.dataset_path is required"),
        ("initial weights", ["--checkpoint.initial_load_path", str(root / "missing_weights")], "does not exist"),
        ("load step", ["--checkpoint.enable", "--checkpoint.load_step", "7"], "no checkpoints in"),
        ("load step without enable", ["--checkpoint.load_step", "7"],
         "checkpoint.load_step has no effect unless checkpoint.enable = true"),
        ("exclude without enable", ["--checkpoint.exclude_from_loading", "optimizer"],
         "checkpoint.exclude_from_loading has no effect unless checkpoint.enable = true"),
        ("truncated checkpoint", [*RESUME, "--job.dump_folder", str(root / "truncated")],
         "checkpoint/step-2 is damaged: __0_0.distcp is 1000 bytes"),
        ("flipped checkpoint bytes", [*RESUME, "--job.dump_folder", str(root / "flipped")],
         "checkpoint/step-2 is damaged: __0_0.distcp does not match its checksum: bytes 0-"),
        ("truncated, no checksums", [*RESUME, "--job.dump_folder", str(root / "unverified")],
         "step-2 could not be read: __0_0.distcp: it ends before its records do (truncated?); it was not used"),
        ("corrupt .metadata", [*RESUME, "--job.dump_folder", str(root / "corrupt_metadata")],
         "step-2 is corrupt: its .metadata cannot be read (invalid load key, 'n'.); it was not used; to resume "
         "from an earlier one: --checkpoint.load_step 1"),
        ("a file checksums.json leaves out", [*RESUME, "--job.dump_folder", str(root / "unlisted")],
         "checkpoint/step-2 is damaged: __0_1.distcp is not in its checksums.json (added after saving?)"),
        ("a data file gone", [*RESUME, "--job.dump_folder", str(root / "gone")],
         "checkpoint/step-2 is damaged: __0_3.distcp is missing"),
        ("a step folder linked", [*RESUME, "--job.dump_folder", str(root / "linked")],
         f"linked/checkpoint/step-2 is a symbolic link (to {root / 'run' / 'checkpoint' / 'step-2'}), not a "
         "checkpoint of this run"),
        ("another run's checkpoint", [*RESUME, "--job.dump_folder", str(root / "other_run")],
         "belongs to another run (run "),
        ("damaged checksums", [*RESUME, "--job.dump_folder", str(root / "bad_manifest")],
         "checkpoint/step-2 is damaged: its checksums.json cannot be read"),
        ("another model's checkpoint", [*RESUME, "--model.flavor", "debugmodel",
                                        "--job.dump_folder", str(root / "other_model")], "holds a different model"),
        ("another model's arguments", [*RESUME, "--model.args", "rope_theta=10000", "--job.dump_folder",
                                       str(root / "other_model")], "holds another model (rope_theta 500000.0 there, 10000.0 here)"),
        ("model change allowed, shapes not", [*RESUME, "--checkpoint.allow_model_change", "--model.flavor",
                                              "debugmodel", "--job.dump_folder", str(root / "other_model")],
         "holds a different model: tok_embeddings.weight is (320, 64) there, (320, 256) here"),
    ]  # fmt: skip


def test_each_mistake_gives_one_clear_error_and_harms_nothing(files, tmp_path):
    root = files["root"]
    catalog = cases(root)
    assert len(catalog) >= 30
    before = snapshot(root)
    argvs = []
    for index, (_, argv, _) in enumerate(catalog):
        dump = [] if "--job.dump_folder" in argv else ["--job.dump_folder", str(tmp_path / f"case{index}")]
        argvs.append([*BASE, *dump, *argv])
    results = run_catalog(argvs, tmp_path)
    problems = []
    for (name, _, expected), result in zip(catalog, results):
        errors = [line for line in result["stderr"].splitlines() if line.startswith("error:")]
        if (
            result["code"] != 2
            or len(errors) != 1
            or expected not in errors[0]
            or "Traceback" in result["stderr"]
        ):
            problems.append(f"{name}: code {result['code']}, stderr: {result['stderr'][-600:]}")
    assert not problems, "\n".join(problems)
    after = snapshot(root)
    assert {k: v for k, v in after.items() if k in before} == before  # nothing changed or deleted
    assert not [p for p in tmp_path.rglob("*.partial")] and not [p for p in root.rglob("*.partial")]


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["--parallelism.context_parallel_degree", "2", "--training.seq_len", "30"],
         "training.seq_len (30) must divide into 2 x context_parallel_degree = 4 chunks"),
        (["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_async_tensor_parallel", "--compile.enable"],
         "parallelism.enable_async_tensor_parallel needs CUDA GPUs (symmetric memory); this run is on cpu"),
    ],
)  # fmt: skip
def test_layout_mistakes_on_several_ranks(overrides, expected, tmp_path):
    result = run_train([*BASE, *overrides, "--job.dump_folder", str(tmp_path)], nproc=2, check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(errors) == 1 and expected in errors[0], result.stderr[-2000:]
