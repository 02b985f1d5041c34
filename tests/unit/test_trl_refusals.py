"""What PoplarSFTTrainer and PoplarDPOTrainer refuse, before anything is built (no process group)."""

from __future__ import annotations

import pytest

pytest.importorskip("trl", reason="the TRL integration needs pip install 'poplar-ext[trl]'")

from trl import DPOConfig, SFTConfig  # noqa: E402

from poplar_ext.integrations.trl import PoplarDPOTrainer, PoplarSFTTrainer  # noqa: E402


def _gpt2(attention: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16, n_positions=8)
    config._attn_implementation = attention
    return GPT2LMHeadModel(config)


@pytest.mark.parametrize("loss_type", ["aot", "aot_unpaired", "sft"])
def test_dpo_losses_of_the_whole_micro_batch_are_refused(tmp_path, loss_type):
    args = DPOConfig(output_dir=str(tmp_path), loss_type=["sigmoid", loss_type], use_cpu=True, bf16=False)
    with pytest.raises(
        ValueError, match=f"DPOConfig.loss_type: expected losses computed per pair, found '{loss_type}'"
    ):
        PoplarDPOTrainer(model=None, args=args)


@pytest.mark.parametrize("fields", [{"packing": True, "packing_strategy": "bfd"}, {"padding_free": True}])
def test_padding_free_batches_without_flash_attention_are_refused(tmp_path, fields):
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **fields)
    with pytest.raises(
        ValueError, match=r"flattens each micro-batch into one sequence, and the model's attention \('sdpa'\)"
    ):
        PoplarSFTTrainer(model=_gpt2("sdpa"), args=args)
