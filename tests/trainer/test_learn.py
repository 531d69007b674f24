"""`rlkit.learn.Learn` (the learn half of a step) with a recording stand-in for the learner: which rows
phase 3 scores, the loss mask the update receives (zero-std groups, the overlong filter, stale tokens) and the
advantages it trains on (the estimator's, plus distillation's term). Every expected value is worked out by
hand below; no model, no process: the fast tier's view of rlkit/learn.py, as test_sync.py is of rlkit/sync.py."""

import math
from types import SimpleNamespace

import pytest
import torch

from rlkit.batch import RolloutBatch, ScoredBatch
from rlkit.config.schema import RLConfig
from rlkit.learn import Learn
from rlkit.learner.logprobs import LogProbs
from rlkit.timing import Timers

# Four rows in two groups of two; row lengths 3, 2, 3, 1.
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
# The policy's and the teacher's log-probs of the sampled tokens (what the recorder's forward returns).
LOGP = torch.tensor([[-1.0, -2.0, -0.5], [-0.25, -1.5, 0.0], [-3.0, -1.0, -2.0], [-0.75, 0.0, 0.0]])
TEACHER = torch.tensor([[-0.5, -2.5, -0.5], [-1.25, -1.0, 0.0], [-1.0, -1.0, -1.0], [-0.25, 0.0, 0.0]])
# GRPO on a group (0, 1): mean 0.5, unbiased std sqrt(0.5); (r - mean) / (std + 1e-6).
A = 0.5 / (math.sqrt(0.5) + 1e-6)


class RecordingLearner:
    """What Learn asks of a learner: its device, an unwrappable model, `forward` and `update`. Records
    how many rows each forward scored and the TrainBatch (and reused-forward scores) each update received."""

    def __init__(self):
        self.device = torch.device("cpu")
        self.model = torch.nn.Linear(1, 1)  # no dropout: the reused forward is allowed
        self.accelerator = SimpleNamespace(unwrap_model=lambda model: model)
        self.forwards, self.updates = [], []

    def forward(self, seqs, *, policy=True, ref=False, values=False, teacher=False):
        n = seqs.response_ids.shape[0]
        self.forwards.append({"rows": n, "policy": policy, "teacher": teacher})
        mask = seqs.response_mask.bool()
        zero = torch.zeros(mask.shape)
        if teacher:
            return LogProbs(teacher_logprobs=TEACHER[:n].masked_fill(~mask, 0.0))
        return LogProbs(logprobs=LOGP[:n].masked_fill(~mask, 0.0), entropy=zero)

    def update(self, batch, scores=None):
        self.updates.append((batch, scores))
        return {}


def cfg(**algo):
    c = RLConfig()
    c.rollout.group_size = 2
    c.trainer.reuse_update_forward = False  # a separate scoring pass unless a test asks for the reused one
    for key, value in algo.items():
        setattr(c.algo, key, value)
    return c


def produced(rewards, *, finish=("stop",) * 4, versions=None, policy_version=0) -> ScoredBatch:
    rb = RolloutBatch(
        prompt_ids=torch.ones(4, 2, dtype=torch.long),
        prompt_mask=torch.ones(4, 2, dtype=torch.bool),
        response_ids=torch.full((4, 3), 7),
        response_mask=MASK,
        rollout_logprobs=LOGP.masked_fill(~MASK, 0.0),
        finish_reasons=tuple(finish),
        group_index=torch.tensor([0, 0, 1, 1]),
        group_size=2,
        token_versions=versions,
    )
    r = torch.tensor(rewards, dtype=torch.float32)
    return ScoredBatch(rb, r, r >= 1, {}, 0, 0, {}, policy_version)


def learn(c, batch, *, step=1):
    learner = RecordingLearner()
    stats = Learn(c, learner, world=1)(batch, step, Timers())
    assert len(learner.updates) == 1
    return learner, learner.updates[0][0], stats


def test_zero_std_groups_leave_the_loss_mask_and_the_others_get_grpo_advantages():
    _, tb, stats = learn(cfg(), produced([1.0, 1.0, 0.0, 1.0]))
    assert not tb.response_mask[:2].any()  # group 0: rewards 1, 1 (no signal)
    assert torch.equal(tb.response_mask[2:], MASK[2:])
    expected = torch.tensor([0.0, 0.0, -A, A])[:, None].expand(4, 3) * MASK
    torch.testing.assert_close(tb.advantages * MASK, expected)
    assert stats["frac_reward_zero_std"].item() == pytest.approx(0.5)  # half the rows


def test_without_zero_std_masking_every_sampled_token_trains():
    _, tb, _ = learn(cfg(mask_zero_std_groups=False), produced([1.0, 1.0, 0.0, 1.0]))
    assert torch.equal(tb.response_mask, MASK)


@pytest.mark.parametrize("overlong_filter", [False, True])
def test_the_overlong_filter_takes_rows_cut_by_the_length_cap_out_of_the_loss(overlong_filter):
    batch = produced([0.0, 1.0, 0.0, 1.0], finish=("stop", "length", "stop", "stop"))
    _, tb, _ = learn(cfg(overlong_filter=overlong_filter), batch)
    expected = MASK.clone()
    if overlong_filter:
        expected[1] = False
    assert torch.equal(tb.response_mask, expected)


def test_tokens_older_than_max_token_staleness_leave_the_loss():
    # trained at step 5 with max_token_staleness 1: tokens of versions 4 and 5 train, 3 and older do not
    versions = torch.tensor([[5, 5, 5], [4, 4, -1], [3, 4, 5], [2, -1, -1]])
    batch = produced([0.0, 1.0, 0.0, 1.0], versions=versions, policy_version=3)
    _, tb, stats = learn(cfg(max_token_staleness=1), batch, step=5)
    expected = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 1, 1], [0, 0, 0]], dtype=torch.bool)
    assert torch.equal(tb.response_mask, expected)
    # staleness of the sampled tokens: 0 0 0 | 1 1 | 2 1 0 | 3 -> max 3, mean 8 / 9
    assert stats["staleness/token_max"].item() == 3
    assert stats["staleness/token_mean"].item() == pytest.approx(8 / 9)


def test_distillation_adds_the_teachers_term_and_masks_no_group():
    c = cfg(distill_coef=0.5, task_coef=2.0)
    learner, tb, _ = learn(c, produced([1.0, 1.0, 0.0, 1.0]))
    assert [f["teacher"] for f in learner.forwards] == [False, True]
    assert torch.equal(tb.response_mask, MASK)  # the teacher's term is informative in every group
    task = torch.tensor([0.0, 0.0, -A, A])[:, None]
    expected = (2.0 * task + 0.5 * (TEACHER - LOGP)) * MASK  # -reverse KL = teacher - policy, per token
    torch.testing.assert_close(tb.advantages, expected)


@pytest.mark.parametrize(
    "algo,rows",
    [({}, 2), ({"rollout_is": {"enabled": True}}, 4)],
    ids=["mismatch-rows-only", "every-row-for-is-weights"],
)
def test_phase_3_scores_mismatch_samples_rows_unless_the_update_needs_every_row(algo, rows):
    c = cfg()
    c.rollout.mismatch_samples = 2
    if "rollout_is" in algo:
        c.algo.rollout_is.enabled = True
    learner, tb, _ = learn(c, produced([0.0, 1.0, 0.0, 1.0]))
    assert [f["rows"] for f in learner.forwards] == [rows]
    assert (tb.is_weights is not None) == (rows == 4)


def test_the_reused_forward_scores_in_the_update_and_runs_no_pass_of_its_own():
    c = cfg()
    c.trainer.reuse_update_forward = True
    c.rollout.mismatch_samples = 3
    learner, tb, stats = learn(c, produced([1.0, 1.0, 0.0, 1.0]))
    assert learner.forwards == []
    _, scores = learner.updates[0]
    assert torch.equal(scores.mask, MASK & torch.tensor([True, True, True, False])[:, None])
    assert not tb.response_mask[:2].any() and torch.equal(tb.response_mask[2:], MASK[2:])


def test_routing_replay_routes_reach_the_forward_and_the_update_and_their_absence_is_refused():
    """algo.routing_replay: the batch's routed_experts reach the scoring forward and the TrainBatch; a batch
    without them (rebuilt by a path that drops them) is refused rather than trained without replay."""
    import dataclasses

    seen = []

    class RoutesLearner(RecordingLearner):
        def forward(self, seqs, **kw):
            seen.append(seqs.routed_experts)
            return super().forward(seqs, **kw)

    routes = torch.arange(4 * 5 * 2 * 2, dtype=torch.int16).reshape(4, 5, 2, 2)
    sb = produced([1.0, 0.0, 0.0, 1.0])
    sb = dataclasses.replace(sb, rollout=dataclasses.replace(sb.rollout, routed_experts=routes))
    learner = RoutesLearner()
    Learn(cfg(routing_replay=True), learner, world=1)(sb, 1, Timers())
    assert torch.equal(seen[0], routes[: seen[0].shape[0]])
    assert torch.equal(learner.updates[0][0].routed_experts, routes)
    with pytest.raises(RuntimeError, match="carries no routed_experts"):
        Learn(cfg(routing_replay=True), RecordingLearner(), world=1)(
            produced([1.0, 0.0, 0.0, 1.0]), 1, Timers()
        )
