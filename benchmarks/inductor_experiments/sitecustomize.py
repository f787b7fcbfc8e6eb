"""Inductor settings to measure, without touching the training code: put this folder first on
PYTHONPATH and name the settings in INDUCTOR_EXPERIMENT (comma-separated); Python imports this
file at start-up in every process (train.py under benchmarks/benchmark.py included).

    PYTHONPATH=benchmarks/inductor_experiments INDUCTOR_EXPERIMENT=aligned_splits \
        python3 benchmarks/benchmark.py --config configs/llama3_3b.toml -- --float8.enable true

aligned_splits      split reductions into chunks whose length is a multiple of 16 elements.
                    Inductor splits a whole-tensor reduction (a float8 amax) into about 4 parts
                    per SM; for 2 x 8192 x 8192 elements on the H200's 132 SMs that is 528 parts
                    of 254,201 elements, whose unaligned loads run at ~1.6 TB/s.
tile_reductions     torch._inductor.config.triton.tile_reductions
prefer_nd_tiling    torch._inductor.config.triton.prefer_nd_tiling
coordinate_descent  torch._inductor.config.coordinate_descent_tuning

Measured and not kept in the training code: docs/performance.md, "The float8 casts kernel by
kernel".
"""

import os
import sys

_chosen = [name for name in os.environ.get("INDUCTOR_EXPERIMENT", "").split(",") if name]
_known = {"aligned_splits", "tile_reductions", "prefer_nd_tiling", "coordinate_descent"}
_unknown = sorted(set(_chosen) - _known)
if _unknown:
    print(f"error: INDUCTOR_EXPERIMENT names {_unknown}; known: {sorted(_known)}", file=sys.stderr)
    os._exit(2)  # sys.exit here would print the site module's traceback
if _chosen:
    import sympy
    import torch._inductor.config as inductor_config
    from torch._inductor.choices import InductorChoices

    class AlignedSplits(InductorChoices):
        @staticmethod
        def reduction_split_factor(device, reduction_numel_hint, numel_hint, inner_reduction):
            numel = int(reduction_numel_hint)
            split = InductorChoices.reduction_split_factor(device, numel, numel_hint, inner_reduction)
            if split <= 1 or (numel % split == 0 and (numel // split) % 16 == 0):
                return split
            aligned = [d for d in sympy.divisors(numel) if d > 1 and (numel // d) % 16 == 0]
            return min(aligned, key=lambda d: abs(d - split)) if aligned else split

    if "aligned_splits" in _chosen and hasattr(inductor_config, "inductor_choices_class"):
        inductor_config.inductor_choices_class = AlignedSplits
    elif "aligned_splits" in _chosen:  # older torch: the handler of this (the compiling) thread
        from torch._inductor.virtualized import V

        V.set_choices_handler(AlignedSplits())
    if "tile_reductions" in _chosen:
        inductor_config.triton.tile_reductions = True
    if "prefer_nd_tiling" in _chosen:
        inductor_config.triton.prefer_nd_tiling = True
    if "coordinate_descent" in _chosen:  # as TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1
        inductor_config.coordinate_descent_tuning = True
    print(f"inductor experiment: {', '.join(_chosen)}", file=sys.stderr)
