"""On-policy distillation (`--use-opd`): the teacher's per-token reverse-KL term in the advantages.

The student samples its own responses; a teacher scores the same tokens. Per response token t,

    A'_t = A_t - opd_kl_coef * (log pi_student(y_t | y_<t) - log pi_teacher(y_t | y_<t))

where A_t is the `--advantage-estimator`'s advantage (0 for pure distillation: reward 0 everywhere). The
difference is the one-sample estimate of the reverse KL(pi_student || pi_teacher) at token t (its expectation
over y_t ~ pi_student is the KL), so the policy gradient on A' lowers that KL on the student's own samples.
It is applied after the estimator and before `--normalize-advantages` whitens, as upstream slime does.
"""

from __future__ import annotations

import torch


def apply_opd_kl_to_advantages(
    advantages: list[torch.Tensor],
    student_log_probs: list[torch.Tensor],
    teacher_log_probs: list[torch.Tensor],
    kl_coef: float,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`advantages - kl_coef * (student_log_probs - teacher_log_probs)`, per sample and token.

    Args:
        advantages: One 1D tensor per sample over its response tokens.
        student_log_probs: The student's log-probs of the same tokens (the old log-probs, or the engines' with
            `--use-rollout-logprobs`), at the rollout temperature.
        teacher_log_probs: The teacher's log-probs of the same tokens (`Sample.teacher_log_probs`).
        kl_coef: `--opd-kl-coef`.

    Returns:
        (new advantages, per-token reverse-KL estimates `student - teacher`), float32, on the advantages' devices.

    Raises:
        ValueError: The lists differ in length, or a sample's three tensors differ in size.
    """
    if not len(advantages) == len(student_log_probs) == len(teacher_log_probs):
        raise ValueError(
            f"on-policy distillation got {len(advantages)} advantages, {len(student_log_probs)} student and "
            f"{len(teacher_log_probs)} teacher log-prob lists; one per sample each"
        )
    new_advantages, reverse_kls = [], []
    for i, (adv, student, teacher) in enumerate(zip(advantages, student_log_probs, teacher_log_probs, strict=True)):
        if not adv.numel() == student.numel() == teacher.numel():
            raise ValueError(
                f"sample {i} of the shard has {teacher.numel()} teacher log-probs, {student.numel()} student "
                f"log-probs and {adv.numel()} advantages; the teacher must score exactly the response tokens"
            )
        reverse_kl = student.to(adv.device, torch.float32) - teacher.to(adv.device, torch.float32)
        new_advantages.append(adv.float() - kl_coef * reverse_kl)
        reverse_kls.append(reverse_kl)
    return new_advantages, reverse_kls
