"""Fine-tune a small denoising diffusion model with Hugging Face accelerate, on a plan's per-GPU batches.

Written the way the diffusers training scripts are (train_unconditional.py): an
Accelerator, ``accelerator.prepare(...)``, ``with accelerator.accumulate(model):``,
``accelerator.backward(loss)``, ``save_state`` every few steps and ``load_state`` to
resume. The one poplar-ext line is ``PoplarAccelerator`` in place of ``Accelerator``;
the DeepSpeed config (``examples/ds_config_accelerate.json``) carries the ``poplar``
section. The model (a small convolutional noise predictor with a timestep embedding)
and the data (seeded synthetic 16x16 images of soft blobs) are built here: nothing is
downloaded, and diffusers is not needed.

    accelerate launch --config_file examples/accelerate_config.yaml examples/accelerate_diffusion.py
    torchrun --nproc_per_node 2 examples/accelerate_diffusion.py --deepspeed_config examples/ds_config_accelerate.json
    deepspeed --num_gpus 2 examples/accelerate_diffusion.py --deepspeed_config examples/ds_config_accelerate.json

What differs from a plain Accelerator: each rank trains its plan's micro-batch size and
accumulation count (``accelerator.micro_batch_size``, ``gradient_accumulation_steps``);
the DataLoader's batch_size and shuffling are replaced by the plan's sampler; the
gradients are those of the mean loss over the true global batch
(``accelerator.global_batch_size``). Ranks may run different numbers of micro-steps
per optimizer step, so collectives (gather, reduce) go where every rank is alike: at
``accelerator.sync_gradients``.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate.utils import InitProcessGroupKwargs, set_seed

from poplar_ext.integrations.accelerate import PoplarAccelerator

logger = logging.getLogger("accelerate_diffusion")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--output_dir", default="accelerate-diffusion-out", help="checkpoints (save_state) go here")
    parser.add_argument("--num_images", type=int, default=96, help="synthetic training images")
    parser.add_argument("--resolution", type=int, default=16, help="image side, in pixels")
    parser.add_argument("--max_train_steps", type=int, default=6, help="optimizer steps of the true global batch")
    parser.add_argument("--learning_rate", type=float, default=1e-3, help="AdamW's, after the warm-up")
    parser.add_argument("--lr_warmup_steps", type=int, default=2, help="optimizer steps of linear warm-up")
    parser.add_argument("--num_train_timesteps", type=int, default=100, help="noise levels of the DDPM schedule")
    parser.add_argument("--checkpointing_steps", type=int, default=3, help="optimizer steps between save_state calls")
    parser.add_argument(
        "--resume_from_checkpoint",
        default=None,
        help="a checkpoint folder, or 'latest' (the last in --output_dir; none there yet: a new run)",
    )
    parser.add_argument("--seed", type=int, default=0, help="for the data, the model and the noise")
    parser.add_argument(
        "--deepspeed_config",
        help="without accelerate launch (torchrun, deepspeed): the DeepSpeed config, as accelerate's config names it",
    )
    parser.add_argument(
        "--local_rank",
        type=int,
        default=-1,
        help="set by the deepspeed launcher (--local_rank=N); torchrun sets LOCAL_RANK instead",
    )
    args = parser.parse_args()
    counts = ("num_images", "resolution", "max_train_steps", "lr_warmup_steps", "num_train_timesteps")
    for name in (*counts, "checkpointing_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: expected a positive integer, found {getattr(args, name)}")
    return args


class SyntheticImages(torch.utils.data.Dataset):
    """Seeded 1-channel images of soft Gaussian blobs in [-1, 1] (the data a diffusion model learns here)."""

    def __init__(self, num_images: int, resolution: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        axis = torch.linspace(-1, 1, resolution)
        y, x = torch.meshgrid(axis, axis, indexing="ij")
        centres = torch.rand(num_images, 2, generator=generator) * 1.2 - 0.6
        widths = torch.rand(num_images, 1, 1, generator=generator) * 0.3 + 0.15
        distance = (x - centres[:, 0, None, None]) ** 2 + (y - centres[:, 1, None, None]) ** 2
        self.images = (torch.exp(-distance / (2 * widths**2)) * 2 - 1).unsqueeze(1)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> dict:
        return {"input": self.images[index]}


class TinyDenoiser(torch.nn.Module):
    """Predicts the noise in a noisy image at a timestep: two conv blocks with the timestep's embedding added."""

    def __init__(self, channels: int = 32, num_train_timesteps: int = 100) -> None:
        super().__init__()
        self.time_embedding = torch.nn.Embedding(num_train_timesteps, channels)
        self.conv_in = torch.nn.Conv2d(1, channels, 3, padding=1)
        self.block = torch.nn.Sequential(
            torch.nn.GroupNorm(8, channels), torch.nn.SiLU(), torch.nn.Conv2d(channels, channels, 3, padding=1)
        )
        self.conv_out = torch.nn.Conv2d(channels, 1, 3, padding=1)

    def forward(self, sample: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        hidden = self.conv_in(sample) + self.time_embedding(timesteps)[:, :, None, None]
        return self.conv_out(F.silu(hidden + self.block(hidden)))


def add_noise(clean: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor, alphas_cumprod: torch.Tensor):
    """DDPM's forward process: sqrt(a_t) x_0 + sqrt(1 - a_t) noise."""
    alpha = alphas_cumprod[timesteps].view(-1, 1, 1, 1)
    return alpha.sqrt() * clean + (1 - alpha).sqrt() * noise


def denoising_loss(model: torch.nn.Module, clean_images: torch.Tensor, alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """The micro-batch's mean squared error of the predicted noise, at random timesteps."""
    noise = torch.randn_like(clean_images)
    timesteps = torch.randint(0, len(alphas_cumprod), (clean_images.shape[0],), device=clean_images.device)
    noise_pred = model(add_noise(clean_images, noise, timesteps, alphas_cumprod), timesteps)
    return F.mse_loss(noise_pred.float(), noise.float())


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.deepspeed_config:
        # What `accelerate launch` sets from its config file: the same DeepSpeed config under torchrun or deepspeed.
        os.environ.setdefault("ACCELERATE_USE_DEEPSPEED", "true")
        os.environ.setdefault("ACCELERATE_DEEPSPEED_CONFIG_FILE", args.deepspeed_config)
    # accelerate picks no distributed backend for DeepSpeed on CPU ranks by itself.
    handlers = [] if torch.cuda.is_available() else [InitProcessGroupKwargs(backend="gloo")]
    betas = torch.linspace(1e-4, 0.02, args.num_train_timesteps)
    alphas_cumprod = torch.cumprod(1 - betas, dim=0)
    accelerator = PoplarAccelerator(
        project_dir=args.output_dir,
        kwargs_handlers=handlers,
        # What the automatic mode (no plan in the poplar section) profiles: the model does not return a loss.
        loss_fn=lambda engine, batch: denoising_loss(engine, batch["input"], alphas_cumprod.to(batch["input"].device)),
    )
    set_seed(args.seed)

    model = TinyDenoiser(num_train_timesteps=args.num_train_timesteps)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=1e-2)
    dataset = SyntheticImages(args.num_images, args.resolution, seed=args.seed)
    # batch_size and shuffle are what a plain script has; the plan's sampler replaces them (a batch_size x
    # processes other than examples/plan_accelerate.json's global batch of 12 is logged as replaced).
    train_dataloader = torch.utils.data.DataLoader(dataset, batch_size=6, shuffle=True)
    # accelerate's convention (as in diffusers): the scheduler steps once per process per optimizer step.
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / (args.lr_warmup_steps * accelerator.num_processes))
    )
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler
    )
    alphas_cumprod = alphas_cumprod.to(accelerator.device)

    logger.info(
        "rank %d: micro-batch %d x %d accumulation steps; true global batch %d",
        accelerator.process_index,
        accelerator.micro_batch_size,
        accelerator.gradient_accumulation_steps,
        accelerator.global_batch_size,
    )
    global_step = 0
    path = args.resume_from_checkpoint
    if path == "latest":
        folders = sorted(Path(args.output_dir).glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        path = str(folders[-1]) if folders else None
        if path is None:  # as diffusers' scripts do: nothing saved yet in --output_dir
            logger.info("Checkpoint 'latest' does not exist. Starting a new training run.")
    if path:
        accelerator.load_state(path)  # the data continues where it stopped: no skip_first_batches needed
        global_step = int(Path(path).name.split("-")[1])
        logger.info("resumed from %s at step %d", path, global_step)

    model.train()
    sum_loss = torch.zeros((), device=accelerator.device)
    while global_step < args.max_train_steps:  # one pass over the dataloader: the rest of an epoch
        for batch in train_dataloader:
            clean_images = batch["input"]
            with accelerator.accumulate(model):
                loss = denoising_loss(model, clean_images, alphas_cumprod)  # the micro-batch mean, as usual
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            sum_loss += loss.detach() * clean_images.shape[0]
            if accelerator.sync_gradients:  # every rank is here once per optimizer step
                global_step += 1
                mean_loss = accelerator.reduce(sum_loss, reduction="sum") / accelerator.global_batch_size
                sum_loss.zero_()
                if accelerator.is_main_process:
                    logger.info(
                        "step %d: loss %.4f over the global batch of %d, lr %.2e",
                        global_step,
                        mean_loss.item(),
                        accelerator.global_batch_size,
                        lr_scheduler.get_last_lr()[0],
                    )
                if global_step % args.checkpointing_steps == 0:
                    accelerator.save_state(os.path.join(args.output_dir, f"checkpoint-{global_step}"))
                if global_step >= args.max_train_steps:
                    break
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
