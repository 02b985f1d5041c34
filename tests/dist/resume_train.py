"""Training script for the resume-on-a-changed-cluster test (run by torchrun).

``--phase first``: 3 ranks train STEPS optimizer steps at each ZeRO stage and save a
checkpoint. ``--phase resumed``: 2 ranks, another plan, load it and train STEPS more.
Each rank records the sample indices it trained; rank 0 saves the parameters.
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
    import poplar_ext

    root = Path(args.root)
    rank = int(os.environ["RANK"])
    for stage in (int(s) for s in args.stages.split(",")):
        model = t.GPT(t.TINY)
        engine, *_ = poplar_ext.initialize(
            model=model,
            optimizer=t.make_optimizer("adam", model.parameters()),
            config=str(root / args.phase / f"ds{stage}.json"),
        )
        data = t.dataset()
        seen: list[list[int]] = []
        checkpoints = root / f"checkpoints{stage}"
        if args.phase == "resumed":
            engine.load_checkpoint(checkpoints)  # the latest tag
        start = engine.data_position
        loader = torch.utils.data.DataLoader(
            data, batch_sampler=t.RecordingSampler(engine.create_batch_sampler(len(data)), seen)
        )
        t.train_steps(engine, loader, STEPS)
        if args.phase == "first":
            engine.save_checkpoint(checkpoints)
        params = t.full_parameters(engine)
        out = root / args.phase / f"stage{stage}-rank{rank}.json"
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
            torch.save(params, root / args.phase / f"stage{stage}-params.pt")
    (root / args.phase / f"done-rank{rank}").touch()  # everything written: what an exit abort cannot undo


if __name__ == "__main__":
    main()
