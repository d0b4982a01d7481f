"""The per-step agreement is queued at one step and read at the next (single process here; the
multi-process NaN/SIGTERM paths run in tests/test_checkpoint.py)."""

import math

import pytest
import torch

from muonrun.train.agreement import StepAgreement, non_finite_message


@pytest.mark.parametrize(
    "loss, grad_norm, flags, expected",
    [
        (math.nan, 1.0, [0.0, 1.0], (True, False, False, True)),
        (2.0, math.inf, [1.0, 0.0], (False, True, True, False)),
        (2.0, 1.0, [0.0, 0.0], (False, False, False, False)),
    ],
)
def test_settle_returns_what_was_launched_once(loss, grad_norm, flags, expected):
    agreement = StepAgreement()
    assert agreement.settle() is None
    agreement.launch(7, torch.tensor(loss), torch.tensor(grad_norm), flags)
    agreed = agreement.settle()
    assert agreed.step == 7
    assert (agreed.loss_bad, agreed.norm_bad, agreed.stop, agreed.writing) == expected
    assert agreement.settle() is None  # read once


@pytest.mark.parametrize("rank, world_size", [(0, 1), (2, 4), (3, 4)])
def test_a_non_finite_loss_names_its_rank(rank, world_size):
    """A non-finite loss enters the MAX as world_size - rank: the agreed value names the lowest rank
    with one (one process here, so that is this rank)."""
    agreement = StepAgreement(rank, world_size)
    agreement.launch(3, torch.tensor(math.inf), torch.tensor(1.0), [0.0, 0.0])
    agreed = agreement.settle()
    assert agreed.loss_bad and agreed.bad_loss_rank == rank and not agreed.norm_bad
    agreement.launch(4, torch.tensor(1.0), torch.tensor(1.0), [0.0, 0.0])
    assert agreement.settle().bad_loss_rank is None


def test_the_non_finite_message_says_where_and_what_a_rerun_does():
    agreement = StepAgreement()
    agreement.launch(5, torch.tensor(math.nan), torch.tensor(math.inf), [0.0, 0.0])
    agreed = agreement.settle()
    alone = non_finite_message(agreed, world_size=1, resume_step=None)
    assert "at step 5 (loss not finite, gradient norm inf)" in alone and "start again (no checkpoint" in alone
    several = non_finite_message(agreed, world_size=4, resume_step=4)
    assert "loss not finite on rank 0 (the lowest such rank)" in several
    assert "resumes from the last checkpoint, step-4, which is intact" in several


def test_a_non_finite_first_step_is_not_blamed_on_the_learning_rate():
    """Step 1's loss comes from the model as built (+model.hf.rope_theta=-5, say): no update happened yet."""
    agreement = StepAgreement()
    agreement.launch(1, torch.tensor(math.nan), torch.tensor(1.0), [0.0, 0.0])
    text = non_finite_message(agreement.settle(), world_size=2, resume_step=None)
    assert "at step 1 (loss not finite on rank 0 (the lowest such rank)), before any update" in text
    assert "the learning rate is not the cause" in text and "model.hf" in text
    assert "Lower the learning" not in text
