"""What PoplarTrainerMixin refuses from the Trainer subclass it is mixed into, before anything is built."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="PoplarTrainerMixin needs pip install 'poplar-ext[hf]'")

from transformers import Trainer  # noqa: E402

from poplar_ext.integrations.transformers import PoplarTrainerMixin  # noqa: E402


class CurriculumTrainer(Trainer):
    def _get_train_sampler(self, train_dataset=None):
        return None


class OwnLoaderTrainer(Trainer):
    def get_train_dataloader(self):
        return None


@pytest.mark.parametrize("base", [CurriculumTrainer, OwnLoaderTrainer])
def test_a_subclass_choosing_its_own_training_batches_is_refused(base):
    name = "_get_train_sampler" if base is CurriculumTrainer else "get_train_dataloader"

    class Mixed(PoplarTrainerMixin, base):
        pass

    with pytest.raises(ValueError, match=f"Mixed: {base.__name__}.{name}: expected the Trainer's own"):
        Mixed(model=None, args=None)


def test_a_class_derived_from_the_mixed_one_may_wrap_the_plans_loader():
    # Above the mixin in the MRO: it calls super() and gets the plan's loader (tests/dist/test_trl.py
    # records the batches so); only the missing deepspeed config stops this one.
    class Mixed(PoplarTrainerMixin, Trainer):
        pass

    class Recording(Mixed):
        def get_train_dataloader(self):
            return super().get_train_dataloader()

    with pytest.raises(ValueError, match=r"Recording: expected TrainingArguments\(deepspeed=...\)"):
        Recording(model=None, args=None)
