"""On-policy distillation end to end on CPU (tiny random models sharing SmolLM2's tokenizer): the advantages
the learner trains on equal a hand computation with plain transformers; a teacher equal to the student
leaves the weights unchanged; 2 async learner processes with micro-batches and 2 rollout workers equal 1
and 1; exact resume; async equals sync; a tokenizer mismatch is refused before any model loads."""

import pytest
import torch
from run_helpers import checkpoint_weights, one_and_two_processes, overrides, read_jsonl, tiny, train  # noqa: F401

from rlkit.algos import advantages as adv
from rlkit.config.schema import ConfigError
from rlkit.learn import Learn
from rlkit.learner import Learner
from rlkit.models import load_causal_lm, make_tiny_checkpoint
from rlkit.train import compose, load_config

pytestmark = pytest.mark.slow  # trainer runs: `make test-fast` leaves it out


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A second tiny model with the same tokenizer and other weights."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("teacher"), hidden_size=32, num_layers=2, seed=1)


def _distill(teacher_path, *extra):
    return (f"algo.teacher.path={teacher_path}", "algo.distill_coef=0.5", *extra)


def _hand_logprobs(model, rb) -> torch.Tensor:
    """[N, T] log-probs of each sampled token, one unpadded row at a time through a plain forward."""
    out = torch.zeros(rb.response_ids.shape)
    with torch.no_grad():
        for i in range(rb.response_ids.shape[0]):
            prompt = rb.prompt_ids[i][rb.prompt_mask[i]]
            n = int(rb.response_mask[i].sum())
            response = rb.response_ids[i, :n]
            ids = torch.cat([prompt, response])[None]
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
            out[i, :n] = torch.log_softmax(logits, -1).gather(-1, response[:, None])[:, 0]
    return out


def _spy(monkeypatch):
    seen = {"produced": [], "batches": []}
    learn, update = Learn.__call__, Learner.update

    def spy_learn(self, produced, *a, **k):
        seen["produced"].append(produced)
        return learn(self, produced, *a, **k)

    def spy_update(self, batch):
        seen["batches"].append(batch)
        return update(self, batch)

    monkeypatch.setattr(Learn, "__call__", spy_learn)
    monkeypatch.setattr(Learner, "update", spy_update)
    return seen


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_trained_advantages_equal_a_hand_computation(tiny, teacher, tmp_path, monkeypatch, lora):  # noqa: F811
    """Step 1: advantage = task_coef x GRPO(rewards) + distill_coef x (log p_teacher - log p_student), the
    log-probs computed here by plain transformers forwards of the two checkpoints. With LoRA the teacher is its
    own model, not the policy with adapters off (which is the reference, here with a KL term too)."""
    seen = _spy(monkeypatch)
    extra = ("model.lora.rank=4", "model.lora.alpha=8", "algo.kl_coef=0.05") if lora else ()
    history = train(tiny, tmp_path / "r", "trainer.steps=1", "algo.task_coef=2.0", *_distill(teacher), *extra)
    rb = seen["produced"][0].rollout
    rewards = seen["produced"][0].rewards
    mask = rb.response_mask.bool()
    student_lp = _hand_logprobs(load_causal_lm(tiny), rb)
    teacher_lp = _hand_logprobs(load_causal_lm(teacher), rb)
    seq = adv.grpo(rewards.float(), 4)
    assert seq.abs().sum() > 0 and (student_lp - teacher_lp)[mask].abs().min() > 0  # both parts matter
    want = torch.where(mask, 2.0 * seq[:, None] + 0.5 * (teacher_lp - student_lp), 0.0)
    got = seen["batches"][0].advantages.cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # every group stays in the loss (the distillation term is informative in zero-std groups too)
    assert torch.equal(seen["batches"][0].response_mask.cpu().bool(), mask)
    m = history[0]
    n = mask.sum()
    assert m["distill/reverse_kl"] == pytest.approx(
        float((student_lp - teacher_lp)[mask].sum() / n), rel=1e-4
    )
    assert m["distill/teacher_logprob"] == pytest.approx(float(teacher_lp[mask].sum() / n), rel=1e-4)
    d_abs = float((0.5 * (teacher_lp - student_lp)).abs()[mask].sum() / n)
    t_abs = float((2.0 * seq[:, None].expand_as(mask)).abs()[mask].sum() / n)
    assert m["distill/teacher_share"] == pytest.approx(d_abs / (d_abs + t_abs), rel=1e-4)
    assert m["timing/teacher_s"] > 0


def test_a_teacher_equal_to_the_student_leaves_the_weights_unchanged(tiny, teacher, tmp_path):  # noqa: F811
    """Pure distillation (algo.task_coef=0) from the student's own checkpoint: the term is 0 everywhere, so a
    step with lr > 0 leaves every weight exactly as it was; the same step from another teacher moves them."""
    initial = _weights_of(tiny)
    same = train(
        tiny,
        tmp_path / "same",
        "trainer.steps=1",
        "trainer.save_every=1",
        "algo.task_coef=0",
        *_distill(tiny),
    )
    assert same[0]["distill/reverse_kl"] == 0 and same[0]["distill/adv_abs"] == 0
    assert same[0]["grad_norm"] == 0
    after = checkpoint_weights(tmp_path / "same/checkpoints/step_1")
    assert after.keys() == initial.keys()
    for k in initial:
        assert torch.equal(after[k], initial[k]), k
    other = train(tiny, tmp_path / "other", "trainer.steps=1", "algo.task_coef=0", *_distill(teacher))
    assert other[0]["distill/reverse_kl"] != 0 and other[0]["grad_norm"] > 0
    moved = checkpoint_weights(tmp_path / "other/checkpoints/step_1")
    assert any(not torch.equal(moved[k], initial[k]) for k in initial)


def _weights_of(path):
    from pathlib import Path

    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_two_async_learners_with_micro_batches_and_two_workers_equal_one_and_one(tiny, teacher, tmp_path):  # noqa: F811
    """Two features' 2-process checks share one pair of launches (a pair costs over a minute):
    - distillation: the step's gradient is the full batch's, 1 process with one micro-batch against 2 gloo
      processes under FSDP2 (the teacher sharded like the policy) each splitting its rows into micro-batches of
      at most 64 tokens (metrics and weights);
    - async (trainer.max_staleness=1): the launcher's 2 gloo learner ranks (batch scattered by rank 0) and 2
      rollout workers (their own gloo world, shares merged in rank order) give the metrics of 1 learner + 1
      worker, the second batch one version old in both."""
    async_ = ("trainer.mode=async", "trainer.max_staleness=1")
    common = overrides(
        tiny, "X", "rollout.seed_per_prompt=true", *_distill(teacher), "trainer.save_every=2", *async_
    )
    keys = ("reward/mean", "distill/reverse_kl", "distill/teacher_logprob", "loss/total", "grad_norm")
    keys += ("mismatch/kl", "rollout/entropy", "response_length/mean", "accuracy", "reward/std")
    keys += ("staleness/max", "rollout_is/mean")
    extra = {
        1: ["trainer.max_tokens_per_microbatch=4096"],
        2: ["trainer.max_tokens_per_microbatch=64", "trainer.strategy=fsdp2", "trainer.rollout_gpus=2"],
    }
    runs = one_and_two_processes(tmp_path, common, keys, extra)
    one, two = (read_jsonl(runs[n] / "metrics.jsonl") for n in (1, 2))
    assert two[0]["eval/pass@1"] == pytest.approx(one[0]["eval/pass@1"])  # the baseline eval
    assert [m["staleness/max"] for m in two[1:]] == [0, 1]
    w1, w2 = (
        checkpoint_weights(runs[1] / "checkpoints/step_2"),
        checkpoint_weights(runs[2] / "checkpoints/step_2"),
    )
    assert w1.keys() == w2.keys()  # a tied head saved once under FSDP2 too (its gathered copy is not)
    for k in w1:
        # Adam's per-element normalisation: see test_dynamic.test_refill_and_lora_under_fsdp2_two_processes_equal_one
        torch.testing.assert_close(w1[k], w2[k], rtol=0, atol=5e-4)


def test_exact_resume_and_async_equal_sync(tiny, teacher, tmp_path):  # noqa: F811
    """4 steps straight equal 2 + resume + 2; the async schedule at staleness 0 equals the sync run (with the
    IS correction that async turns on by default, as in test_async.py)."""
    d = (*_distill(teacher), "algo.rollout_is.enabled=true")
    straight = train(tiny, tmp_path / "a", "trainer.steps=4", *d)
    first = train(tiny, tmp_path / "b", "trainer.steps=2", *d)
    second = train(tiny, tmp_path / "b", "trainer.steps=4", "trainer.resume=auto", *d)
    asynchronous = train(
        tiny, tmp_path / "c", "trainer.steps=4", "trainer.mode=async", "trainer.max_staleness=0", *d
    )
    keys = ["reward/mean", "distill/reverse_kl", "distill/teacher_logprob", "loss/total", "grad_norm"]
    for want, got, other in zip(straight, first + second, asynchronous, strict=True):
        for k in keys:
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7), k
            assert other[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k
    wa, wb = (
        checkpoint_weights(tmp_path / "a/checkpoints/step_4"),
        checkpoint_weights(tmp_path / "b/checkpoints/step_4"),
    )
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6)


def _other_tokenizer_model(directory):
    """A tiny model whose tokenizer has one extra token."""
    from rlkit.models import load_tokenizer

    path = make_tiny_checkpoint(directory, hidden_size=32, num_layers=2, seed=2)
    tok = load_tokenizer(path)
    tok.add_tokens(["<rlkit-extra>"])
    tok.save_pretrained(path)
    return path


def test_a_tokenizer_mismatch_is_refused_before_any_model_loads(tiny, tmp_path, monkeypatch):  # noqa: F811
    other = _other_tokenizer_model(tmp_path / "other")

    def no_model(*a, **k):
        raise AssertionError("a model was loaded")

    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_model)
    with pytest.raises(ConfigError) as e:
        load_config(compose(overrides(tiny, tmp_path / "r", *_distill(other))))
    msg = str(e.value)
    assert "algo.teacher.path" in msg and other in msg and tiny in msg and "tokenizer" in msg
