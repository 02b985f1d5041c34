"""What PoplarSFTTrainer and PoplarDPOTrainer refuse, before anything is built (no process group); each
refusal ends a restarting launcher's job (the same at every restart)."""

from __future__ import annotations

import pytest

pytest.importorskip("trl", reason="the TRL integration needs pip install 'poplar-ext[trl]'")

from trl import DPOConfig, SFTConfig  # noqa: E402

from poplar_ext.integrations.trl import PoplarDPOTrainer, PoplarSFTTrainer  # noqa: E402


@pytest.fixture
def ended(monkeypatch) -> list[BaseException]:
    """The errors `poplar_ext.elastic.end_restarting_launcher` was asked to end the job for."""
    import poplar_ext.elastic as elastic

    asked: list[BaseException] = []
    monkeypatch.setattr(elastic, "end_restarting_launcher", asked.append)
    return asked


def _gpt2(attention: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16, n_positions=8)
    config._attn_implementation = attention
    return GPT2LMHeadModel(config)


@pytest.mark.parametrize("loss_type", ["aot", "aot_unpaired", "sft"])
def test_dpo_losses_of_the_whole_micro_batch_are_refused(tmp_path, ended, loss_type):
    args = DPOConfig(output_dir=str(tmp_path), loss_type=["sigmoid", loss_type], use_cpu=True, bf16=False)
    with pytest.raises(
        ValueError, match=f"DPOConfig.loss_type: expected losses computed per pair, found '{loss_type}'"
    ) as refused:
        PoplarDPOTrainer(model=None, args=args)
    assert ended == [refused.value]


def test_a_dpo_loss_of_the_whole_micro_batch_is_refused_from_a_config_given_by_position(tmp_path):
    args = DPOConfig(output_dir=str(tmp_path), loss_type="aot", use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match="DPOConfig.loss_type: expected losses computed per pair, found 'aot'"):
        PoplarDPOTrainer(None, None, args)  # DPOTrainer(model, ref_model, args)


@pytest.mark.parametrize("fields", [{"packing": True, "packing_strategy": "bfd"}, {"padding_free": True}])
def test_padding_free_batches_without_flash_attention_are_refused(tmp_path, ended, fields):
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **fields)
    with pytest.raises(
        ValueError, match=r"flattens each micro-batch into one sequence, and the model's attention \('sdpa'\)"
    ) as refused:
        PoplarSFTTrainer(model=_gpt2("sdpa"), args=args)
    assert ended == [refused.value]


@pytest.mark.parametrize("init_kwargs", [None, {"attn_implementation": "sdpa"}])
def test_a_model_trl_would_load_by_name_is_refused_from_the_config_before_anything_loads(
    tmp_path, monkeypatch, init_kwargs
):
    # TRL's sft.py documents --packing (bfd) with a model name: refused before any process group or download.
    import poplar_ext.integrations.transformers as integration

    def no_collective(*args, **kwargs):
        raise AssertionError("the plan was resolved (a collective) before the refusal")

    monkeypatch.setattr(integration, "prepare_job", no_collective)
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, packing=True, model_init_kwargs=init_kwargs)
    with pytest.raises(ValueError, match=r"packing=True with packing_strategy='bfd' flattens each micro-batch"):
        PoplarSFTTrainer(model="some-org/some-model", args=args)


def test_padding_free_batches_are_refused_also_for_a_model_and_config_given_by_position(tmp_path, monkeypatch):
    # SFTTrainer(model, args) as TRL's own examples call it: the refusal must not depend on the keywords.
    import poplar_ext.integrations.transformers as integration

    def no_collective(*args, **kwargs):
        raise AssertionError("the plan was resolved (a collective) before the refusal")

    monkeypatch.setattr(integration, "prepare_job", no_collective)
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, padding_free=True)
    with pytest.raises(ValueError, match=r"padding_free=True flattens each micro-batch into one sequence"):
        PoplarSFTTrainer(_gpt2("sdpa"), args)


@pytest.mark.parametrize("trainer", [PoplarSFTTrainer, PoplarDPOTrainer])
def test_an_argument_given_twice_ends_a_restarting_launchers_job(ended, trainer):
    with pytest.raises(TypeError, match="got multiple values for argument 'model'") as refused:
        trainer(None, model=None)
    assert ended == [refused.value]


class _Settled(Exception):
    """Raised by the stand-in for `_settle_job` once it has what the trainer passed it."""


@pytest.fixture
def profiling_collator(monkeypatch, ended):
    """The collate function a TRL trainer gives the job's settling (what the automatic mode profiles with)."""
    from poplar_ext.integrations import transformers as integration

    passed = {}

    def settle(*args, collate_fn, **kwargs):
        passed["collate_fn"] = collate_fn
        raise _Settled

    monkeypatch.setattr(integration, "_settle_job", settle)
    return passed


def _automatic(config_class, tmp_path, **fields):
    return config_class(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to=[],
        deepspeed={"zero_optimization": {"stage": 1}, "poplar": {}},
        **fields,
    )


@pytest.mark.parametrize("trainer", ["sft", "dpo"])
def test_the_automatic_mode_refuses_trls_raw_data_before_profiling_it(tmp_path, profiling_collator, trainer):
    # TRL tokenizes its data set and builds its collator while it is built, after the plan is settled: profiling
    # the raw rows failed late (after the network was measured) with the model's "You must specify exactly one of
    # input_ids or inputs_embeds". The first micro-batch the profiler asks for is refused, saying what to give.
    from datasets import Dataset

    if trainer == "sft":
        build, args, rows = PoplarSFTTrainer, _automatic(SFTConfig, tmp_path), [{"text": "w1 w2"}]
    else:
        build, args, rows = (
            PoplarDPOTrainer,
            _automatic(DPOConfig, tmp_path),
            [{"prompt": "a", "chosen": "b", "rejected": "c"}],
        )
    with pytest.raises(_Settled):
        build(model=_gpt2("sdpa"), args=args, train_dataset=Dataset.from_list(rows))
    with pytest.raises(
        ValueError, match=rf"{build.__name__}: the DeepSpeed config's poplar section has no plan.*expected poplar\.plan"
    ):
        profiling_collator["collate_fn"](rows)


def test_an_iterable_data_set_reaches_the_jobs_own_refusal(tmp_path, profiling_collator):
    # The SFT hook looked at train_dataset[0]: an IterableDataset failed "has no len()" before the job's own
    # "expected a map-style dataset".
    from datasets import Dataset

    data = Dataset.from_list([{"input_ids": [1, 2, 3]}]).to_iterable_dataset()
    with pytest.raises(_Settled):
        PoplarSFTTrainer(model=_gpt2("sdpa"), args=_automatic(SFTConfig, tmp_path), train_dataset=data)


def test_the_automatic_mode_profiles_sft_token_rows_with_the_collator_given(tmp_path, profiling_collator):
    from datasets import Dataset

    def collate(samples):
        return samples

    data = Dataset.from_list([{"input_ids": [1, 2, 3]}])
    with pytest.raises(_Settled):
        PoplarSFTTrainer(
            model=_gpt2("sdpa"), args=_automatic(SFTConfig, tmp_path), train_dataset=data, data_collator=collate
        )
    assert profiling_collator["collate_fn"] is collate


def _mixed_alone(*bases):
    from poplar_ext.integrations.transformers import PoplarTrainerMixin

    return type("Mixed", (PoplarTrainerMixin, *bases), {})


@pytest.mark.parametrize("trainer", ["SFTTrainer", "DPOTrainer", "RewardTrainer"])
def test_the_mixin_alone_on_a_trl_trainer_is_refused_naming_its_poplar_class(ended, trainer):
    # TRL gathers its metrics from every rank in each compute_loss: `class Mixed(PoplarTrainerMixin, SFTTrainer)` hung
    # at its first step on 2 ranks of micro-batches 3 and 1 (RewardTrainer's aborted in gloo: "Received data size
    # doesn't match expected size"), after the job was settled.
    import trl

    with pytest.raises(
        ValueError,
        match=rf"Mixed: PoplarTrainerMixin on trl's {trainer}: expected poplar_ext.integrations.trl's "
        rf"Poplar{trainer} in its place, found the mixin alone; {trainer} gathers its logged metrics",
    ) as refused:
        _mixed_alone(getattr(trl, trainer))(model=None, args=None)
    assert ended == [refused.value]


def test_the_mixin_alone_on_a_subclass_of_a_trl_trainer_is_shown_the_bases_to_use():
    from trl import SFTTrainer

    class MySFT(SFTTrainer):
        pass

    with pytest.raises(
        ValueError, match=r"expected .*PoplarSFTTrainer first in the bases: Mixed\(PoplarSFTTrainer, MySFT\)"
    ):
        _mixed_alone(MySFT)(model=None, args=None)

    class Mine(PoplarSFTTrainer, MySFT):
        pass

    # The bases the refusal names pass it: only the missing deepspeed config stops this one.
    with pytest.raises(ValueError, match=r"Mine: expected TrainingArguments\(deepspeed=...\)"):
        Mine(model=None, args=None)


def test_the_mixin_alone_on_a_trl_trainer_without_a_poplar_class_is_refused():
    from trl import KTOTrainer

    with pytest.raises(ValueError, match=r"PoplarRewardTrainer\), which have no counterpart for KTOTrainer"):
        _mixed_alone(KTOTrainer)(model=None, args=None)


@pytest.mark.parametrize(("ranks", "others"), [(2, "the other rank does"), (3, "the other 2 ranks do")])
def test_precomputed_reference_log_probs_of_a_set_in_memory_are_refused_on_several_ranks(ranks, others):
    # TRL writes them to the set's cache file on the first rank and every rank reads it: on 2 ranks a set from
    # Dataset.from_list failed on the other rank with "FileNotFoundError: Failed to open local file
    # '/tmp/hf_datasets-.../cache-....arrow'" (and the first with a gloo "Connection closed by peer").
    from types import SimpleNamespace

    from datasets import Dataset

    trainer = SimpleNamespace(
        args=SimpleNamespace(precompute_ref_batch_size=2), accelerator=SimpleNamespace(num_processes=ranks)
    )
    in_memory = Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}])
    with pytest.raises(
        ValueError,
        match=rf"DPOConfig.precompute_ref_log_probs: expected the eval data set in files every rank reads .* found one "
        rf"held in memory, .* where {others} not find the first rank's; give a set saved to disk",
    ):
        PoplarDPOTrainer._precompute_ref_logps(trainer, in_memory, "eval", 2)
