"""DeepSpeed checkpoints across numbers of ranks: a ZeRO checkpoint holds one partition of the
optimizer state (and under ZeRO-3 of the weights) per rank that saved it, so a resume on another
number of ranks (another cluster, fewer nodes after a loss) loads it through DeepSpeed's universal
format, which keeps each parameter's weights and optimizer state whole.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
from pathlib import Path

from tasks.store.run_folder import universal_copy


def checkpoint_ranks(folder: Path) -> int | None:
    """How many data-parallel ranks saved a DeepSpeed checkpoint folder: one optimizer-state
    file each under ZeRO; None without ZeRO (one file any number of ranks loads) or no folder."""
    return len(list(folder.glob("*_optim_states.pt"))) or None


def to_universal(directory: Path, tag: str) -> Path:
    """Checkpoint `tag` of `directory` in the universal format, converted once (atomically: into
    a staging folder, then renamed) beside it; returns the folder to load it from with `tag`."""
    from deepspeed.checkpoint import ds_to_universal

    target = universal_copy(directory, tag)
    if target.exists():
        return target
    staging = target.with_suffix(".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    options = argparse.Namespace(
        input_folder=str(directory / tag),
        output_folder=str(staging / tag),
        num_extract_workers=1,  # no process pool inside a rank actor
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        # Our checkpoints carry no model-specific conversion info (none is needed without tensor
        # or pipeline parallelism), only DeepSpeed's format version, which this adds.
        inject_missing_state=True,
    )
    with contextlib.redirect_stdout(io.StringIO()):  # its per-phase prints, not ours
        ds_to_universal.main(options)
    staging.rename(target)
    return target
