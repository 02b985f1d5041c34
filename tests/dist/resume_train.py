"""Training script for the resume-on-a-changed-cluster test (the resume run by torchrun).

``--phase first``: 3 ranks train STEPS optimizer steps at each ZeRO stage and save a
checkpoint. ``--phase resumed``: 2 ranks, another plan, load it and train STEPS more.
Each rank records the sample indices it trained; rank 0 saves the parameters.
`run_phase` is the same on ranks that are already running (the test's forked first phase).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import _training as t
import torch

STEPS = 3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=("first", "resumed"), required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    run_phase(args.phase, Path(args.root), tuple(int(s) for s in args.stages.split(",")))


def run_phase(phase: str, root: Path, stages: tuple[int, ...] = (0, 1, 2, 3)) -> None:
    """`phase` on this rank (RANK from the environment): each of `stages` trained, its files written."""
    import poplar_ext

    rank = int(os.environ["RANK"])
    for stage in stages:
        model = t.GPT(t.TINY)
        engine, *_ = poplar_ext.initialize(
            model=model,
            optimizer=t.make_optimizer("adam", model.parameters()),
            config=str(root / phase / f"ds{stage}.json"),
        )
        data = t.dataset()
        seen: list[list[int]] = []
        checkpoints = root / f"checkpoints{stage}"
        if phase == "resumed":
            engine.load_checkpoint(checkpoints)  # the latest tag
        start = engine.data_position
        loader = torch.utils.data.DataLoader(
            data, batch_sampler=t.RecordingSampler(engine.create_batch_sampler(len(data)), seen)
        )
        t.train_steps(engine, loader, STEPS)
        if phase == "first":
            engine.save_checkpoint(checkpoints)
        params = t.full_parameters(engine)
        out = root / phase / f"stage{stage}-rank{rank}.json"
        out.write_text(
            json.dumps(
                {
                    "seen": seen,
                    "start": start,
                    "end": engine.data_position,
                    "history": [h["reason"] for h in engine.plan_history],
                }
            )
        )
        if rank == 0:
            torch.save(params, root / phase / f"stage{stage}-params.pt")
    (root / phase / f"done-rank{rank}").touch()  # everything written: what an exit abort cannot undo


if __name__ == "__main__":
    main()
