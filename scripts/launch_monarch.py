"""Launch and supervise train.py on a Monarch process mesh: one controller that restarts a failed
job by itself (docs/monarch.md).

    python scripts/launch_monarch.py --nproc-per-host 8 --max-restarts 3 -- \\
        --config configs/llama3_8b.toml --checkpoint.enable
    python scripts/launch_monarch.py --scheduler slurm --hosts 4 --nproc-per-host 8 --gpus-per-host 8 \\
        --partition gpu --time-limit 24:00:00 --max-restarts 10 --hang-timeout 900 -- --config X.toml ...
    python scripts/launch_monarch.py --nproc-per-host 4 --replica-groups 2 --max-restarts 3 -- \\
        --config X.toml                                            # torchft: a failed group heals

Each process of the mesh runs one train.py rank with torchrun's variables (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...). A rank that exits non-zero or is killed, an actor
process that dies, or (--hang-timeout S) no new logged step for S seconds stops the job, which
starts again on a new mesh and resumes from its latest complete checkpoint, up to --max-restarts
times. SIGTERM, SIGUSR1 and Ctrl-C let every rank save and stop (exit 0; 130 after Ctrl-C).
Needs torchmonarch (pip install torchmonarch==0.7.0); training itself does not.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.monarch_launcher.main import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
