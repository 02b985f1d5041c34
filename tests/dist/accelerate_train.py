"""Training script for the launcher test (run by ``accelerate launch``, ``torchrun`` or ``deepspeed``).

The loop as accelerate's documentation writes it, with PoplarAccelerator in place of
Accelerator, on the tests' tiny GPT. Under ``accelerate launch`` the DeepSpeed config
comes from accelerate's config file; under the other launchers from ``--deepspeed_config``
(a DeepSpeedPlugin). Each rank writes the sample indices it trained; rank 0 the parameters.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import _training as t
import torch
from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

from poplar_ext.integrations.accelerate import PoplarAccelerator
from poplar_ext.models.toy_gpt import GPT


class Indexed(torch.utils.data.Dataset):
    def __init__(self):
        self.data = t.dataset()

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return {"tokens": self.data[index], "index": index}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--deepspeed_config", help="without accelerate launch: the DeepSpeed config file")
    parser.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher's
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)  # poplar_ext's lines
    plugin = {} if args.deepspeed_config is None else {"deepspeed_plugin": DeepSpeedPlugin(args.deepspeed_config)}
    gloo = [] if torch.cuda.is_available() else [InitProcessGroupKwargs(backend="gloo")]
    accelerator = PoplarAccelerator(kwargs_handlers=gloo, **plugin)
    torch.manual_seed(0)
    model = GPT(t.TINY)
    optimizer = t.make_optimizer("adam", model.parameters())
    train_dataloader = torch.utils.data.DataLoader(Indexed(), batch_size=4, shuffle=True)
    model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
    seen, done = [], 0
    while done < args.steps:
        for batch in train_dataloader:
            with accelerator.accumulate(model):
                seen.extend(batch["index"].tolist())
                loss = model(batch["tokens"])
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            done += accelerator.sync_gradients
            if done == args.steps:
                break
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"samples-rank{accelerator.process_index}.json").write_text(json.dumps(seen))
    params = t.full_parameters(model)
    if accelerator.is_main_process:
        torch.save(params, out / "params.pt")
    accelerator.end_training()
    (out / f"done-rank{accelerator.process_index}").touch()  # everything written: what an exit abort cannot undo


if __name__ == "__main__":
    main()
