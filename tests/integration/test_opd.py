"""On-policy distillation (--use-opd): the teacher term in the advantages against hand-computed values, the
teacher's log-probs from a real CPU engine against a forward pass of the teacher, the parse-time rules, and one
train.py run in which a student trained toward a different teacher gets measurably closer to it."""

from argparse import Namespace

import pytest
import torch
from support.engines import engine_server
from support.flags import slime_flags
from support.opd import chat_prompt_ids, teacher_forward_log_probs
from support.runs import REPO
from transformers import AutoModelForCausalLM, AutoTokenizer

from slime.algorithms.advantages import compute_advantages_and_returns
from slime.algorithms.opd import apply_opd_kl_to_advantages
from slime.backends.train_actor import TrainRayActor
from slime.rollout.opd import (
    TeacherError,
    fetch_teacher_log_probs,
    score_with_teacher,
    teacher_generate_url,
    teacher_log_probs_from_response,
)
from slime.utils.arguments import ArgumentValidationError, parse_args
from slime.utils.async_utils import run
from slime.utils.http_utils import find_free_port
from slime.utils.types import Sample, Status

EXAMPLE = REPO / "examples" / "on_policy_distillation"

BASE = [
    "--train-backend", "fsdp", "--rollout-backend", "cpu", "--hf-checkpoint", "/models/tiny",
    "--prompt-data", "/data/train.jsonl", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
    "--num-rollout", "2",
]  # fmt: skip


# ---- the advantage term -------------------------------------------------------------------------------------
ADVANTAGES = [[0.5, -0.5, 1.0], [0.0, 2.0]]
STUDENT = [[-1.0, -2.0, -0.5], [-0.3, -1.2]]
TEACHER = [[-1.5, -1.0, -0.5], [-2.3, -0.2]]


def tensors(rows):
    return [torch.tensor(row) for row in rows]


def test_advantages_lose_the_weighted_student_minus_teacher_log_prob():
    advantages, reverse_kl = apply_opd_kl_to_advantages(tensors(ADVANTAGES), tensors(STUDENT), tensors(TEACHER), 0.5)
    # student - teacher: [0.5, -1.0, 0.0] and [2.0, -1.0]; A - 0.5 x that:
    assert [r.tolist() for r in reverse_kl] == [[0.5, -1.0, 0.0], [2.0, -1.0]]
    assert [a.tolist() for a in advantages] == [[0.25, 0.0, 1.0], [-1.0, 2.5]]


def grpo_args(**overrides) -> Namespace:
    settings = dict(
        advantage_estimator="grpo", kl_coef=0.0, kl_loss_type="k1", normalize_advantages=False,
        custom_advantage_function_path=None, use_opd=True, opd_kl_coef=2.0,
    )  # fmt: skip
    return Namespace(**{**settings, **overrides})


def test_the_term_comes_after_the_estimator_and_before_whitening():
    data = {
        "rewards": [1.0, -1.0],
        "loss_masks": [torch.ones(3), torch.tensor([1.0, 0.0])],
        "log_probs": tensors(STUDENT),
        "teacher_log_probs": tensors(TEACHER),
    }
    compute_advantages_and_returns(grpo_args(), data)
    # GRPO puts the reward on every token; then A - 2 x (student - teacher).
    expected = [[1.0 - 1.0, 1.0 + 2.0, 1.0], [-1.0 - 4.0, -1.0 + 2.0]]
    assert [a.tolist() for a in data["advantages"]] == expected
    assert [r.tolist() for r in data["returns"]] == [[1.0] * 3, [-1.0] * 2]  # the returns keep the reward alone

    data.pop("advantages"), data.pop("returns")
    compute_advantages_and_returns(grpo_args(normalize_advantages=True), data)
    trainable = torch.tensor([0.0, 3.0, 1.0, -5.0])  # the masked-out token (1.0) does not enter the statistics
    mean, std = trainable.mean(), trainable.var(unbiased=False).add(1e-8).sqrt()
    whitened = [(torch.tensor(row) - mean) / std for row in expected]
    for got, want in zip(data["advantages"], whitened, strict=True):
        assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.reliability(
    "--use-opd on a shard whose teacher log-probs do not match the response", "ValueError naming the sample"
)
def test_a_misaligned_or_missing_teacher_is_refused():
    with pytest.raises(ValueError, match="sample 1 of the shard has 1 teacher log-probs, 2 student"):
        apply_opd_kl_to_advantages(tensors(ADVANTAGES), tensors(STUDENT), tensors([[0.0] * 3, [0.0]]), 1.0)
    data = {"rewards": [1.0, -1.0], "loss_masks": [torch.ones(3), torch.ones(2)], "log_probs": tensors(STUDENT)}
    with pytest.raises(ValueError, match="teacher_log_probs"):
        compute_advantages_and_returns(grpo_args(), data)

    actor = TrainRayActor.__new__(TrainRayActor)  # the check reads only args; no process group needed
    actor.args = parse_args(BASE + ["--use-opd", "--opd-teacher-url", "http://127.0.0.1:1"])
    shard = {"tokens": [[1, 2, 3], [4, 5]], "response_lengths": [2, 1], "sample_indices": [7, 9]}
    with pytest.raises(ValueError, match="no teacher_log_probs; pass --opd-teacher-url"):
        actor._check_teacher_log_probs(shard)
    shard["teacher_log_probs"] = [torch.zeros(2), torch.zeros(2)]
    with pytest.raises(ValueError, match="sample 9 has 2 teacher log-probs for 1 response tokens"):
        actor._check_teacher_log_probs(shard)


# ---- the teacher's log-probs from a real engine ----------------------------------------------------------------


@pytest.fixture(scope="module")
def teacher_url(teacher_dir):
    with engine_server(teacher_dir) as (_, url):
        yield url


def chat_sample(tokenizer, index: int, question: str, answer: str) -> Sample:
    prompt = chat_prompt_ids(tokenizer, question)
    response = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return Sample(
        index=index, tokens=prompt + response, response_length=len(response), status=Status.COMPLETED
    )  # fmt: skip


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_teacher_log_probs_equal_a_forward_pass_of_the_teacher(teacher_dir, teacher_url, temperature):
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    samples = [
        chat_sample(tokenizer, 0, "What is 12 + 34?", "The answer is \\boxed{46}."),
        chat_sample(tokenizer, 1, "the quick brown fox", "jumps over the lazy dog"),
        chat_sample(tokenizer, 2, "think step by step", "0 1 2"),
    ]
    aborted = Sample(index=3, tokens=samples[0].tokens[:-2], response_length=3, status=Status.ABORTED)
    args = slime_flags(use_opd=True, opd_teacher_url=teacher_url, rollout_temperature=temperature, rm_type="f1")
    run(score_with_teacher(args, [*samples, aborted]))
    worst = 0.0
    for s in samples:
        expected = teacher_forward_log_probs(teacher, s.tokens, s.response_length, temperature)
        assert len(s.teacher_log_probs) == s.response_length
        worst = max(worst, max(abs(a - b) for a, b in zip(s.teacher_log_probs, expected, strict=True)))
    print(f"temperature {temperature}: largest |engine - forward| teacher log-prob gap {worst:.2e}")
    assert worst <= 1e-4
    assert aborted.teacher_log_probs is None  # it goes back to the data source and is scored once it finishes
    assert all(s.reward is None for s in samples)  # a reward function is configured: left to it


def test_pure_distillation_scores_reward_zero_and_eval_skips_the_teacher(teacher_url):
    args = slime_flags(use_opd=True, opd_teacher_url=teacher_url, rollout_temperature=1.0, rm_type=None)
    done = Sample(index=0, tokens=[5, 6, 7, 8], response_length=2, status=Status.TRUNCATED)
    failed = Sample(index=1, tokens=[5, 6, 7], response_length=1, status=Status.FAILED)
    run(score_with_teacher(args, [done, failed], evaluation=True))
    assert done.reward == 0.0 and done.teacher_log_probs is None
    assert failed.reward is None and failed.unfinished  # stays unfinished: masked out, not trained on
    run(score_with_teacher(args, [done, failed]))
    assert len(done.teacher_log_probs) == 2 and len(failed.teacher_log_probs) == 1
    assert teacher_generate_url(teacher_url) == f"{teacher_url}/generate"
    assert teacher_generate_url(f"{teacher_url}/generate") == f"{teacher_url}/generate"


@pytest.mark.reliability("the OPD teacher engine is down or refuses a sample", "TeacherError naming the URL and why")
def test_teacher_failures_name_the_url_and_the_cause(teacher_url):
    sample = Sample(index=4, tokens=[5, 6, 7], response_length=1, status=Status.COMPLETED)
    nobody = f"http://127.0.0.1:{find_free_port()}"
    with pytest.raises(TeacherError, match=f"cannot reach the OPD teacher at {nobody}/generate"):
        run(fetch_teacher_log_probs(slime_flags(opd_teacher_url=nobody, rollout_temperature=1.0), sample))
    beyond_vocab = Sample(index=5, tokens=[5, 6, 100_000], response_length=1, status=Status.COMPLETED)
    args = slime_flags(opd_teacher_url=teacher_url, rollout_temperature=1.0)
    with pytest.raises(TeacherError, match="refused sample 5 .* HTTP 400"):
        run(fetch_teacher_log_probs(args, beyond_vocab))


@pytest.mark.reliability(
    "an OPD teacher that answers without input log-probs, or for other tokens", "TeacherError naming the sample"
)
def test_teacher_answers_must_score_the_samples_own_tokens():
    sample = Sample(index=6, tokens=[5, 6, 7, 8], response_length=2)
    good = {"meta_info": {"input_token_logprobs": [[None, 5, None], [-1.0, 6, None], [-2.0, 7, None], [-3.0, 8, None]]}}
    assert teacher_log_probs_from_response(good, sample, "http://t") == [-2.0, -3.0]
    other_token = {
        "meta_info": {"input_token_logprobs": [[None, 5, None], [-1.0, 6, None], [-2.0, 9, None], [-3.0, 8, None]]}
    }
    with pytest.raises(TeacherError, match="response token 0 of sample 6, which is token 7"):
        teacher_log_probs_from_response(other_token, sample, "http://t")
    with pytest.raises(TeacherError, match="with no input_token_logprobs"):
        teacher_log_probs_from_response({"meta_info": {"output_token_logprobs": []}}, sample, "http://t")


# ---- flags -----------------------------------------------------------------------------------------------------
def test_opd_flags_parse_to_their_upstream_meaning():
    args = parse_args(BASE + ["--use-opd", "--opd-teacher-url", "http://127.0.0.1:30000", "--opd-kl-coef", "0.5"])
    assert (args.use_opd, args.opd_type, args.opd_kl_coef) == (True, "sglang", 0.5)
    # upstream's recipe: user code stores the teacher's log-probs, no URL needed
    args = parse_args(BASE + ["--use-opd", "--custom-reward-post-process-path", "my.module.post_process_rewards"])
    assert args.opd_teacher_url is None


@pytest.mark.reliability("OPD flags that cannot work together", "parse-time error naming the flags and the fix")
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--use-opd"], "needs the teacher's log-probs: pass --opd-teacher-url"),
        (["--opd-kl-coef", "0.5"], "--opd-kl-coef only take effect with --use-opd"),
        (["--opd-teacher-url", "http://127.0.0.1:1"], "--opd-teacher-url only take effect with --use-opd"),
        (["--use-opd", "--opd-teacher-url", "127.0.0.1:30000"], "is not an http"),
        (["--use-opd", "--opd-teacher-url", "http://t:1", "--opd-kl-coef", "-1"], "--opd-kl-coef must be >= 0"),
        (["--use-opd", "--opd-teacher-url", "http://t:1", "--loss-type", "sft_loss"], "--loss-type sft_loss"),
        (["--use-opd", "--opd-type", "megatron"], "a teacher loaded in the trainer"),
        (["--opd-teacher-load", "/ckpt/teacher"], "only --opd-type megatron reads it"),
    ],
)
def test_opd_misuse_fails_at_parse_time(extra, message):
    with pytest.raises(ArgumentValidationError, match=message):
        parse_args(BASE + extra)


# ---- end to end --------------------------------------------------------------------------------------------------
