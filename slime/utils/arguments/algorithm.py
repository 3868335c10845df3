"""The algorithm: advantage estimator, policy loss, KL and loss aggregation (choices from slime.algorithms'
registries, extended by --custom-algorithm-module), on-policy distillation, and the registry wiring."""

from __future__ import annotations

import argparse

from slime import algorithms
from slime.utils.arguments.errors import _fail

# The built-in algorithm names; the flags take their choices from the registries when the parser is built,
# so names registered by --custom-algorithm-module modules are valid too.
ADVANTAGE_ESTIMATORS = algorithms.ADVANTAGE_ESTIMATORS.names()
KL_LOSS_TYPES = algorithms.KL_ESTIMATORS.names()


def _add_algorithm_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("algorithm and loss")
    group.add_argument(
        "--custom-algorithm-module",
        nargs="+",
        default=None,
        metavar="MODULE",
        help="Dotted module paths imported at startup, before the algorithm flags are checked, and in every "
        "trainer process. Their @register_advantage_estimator / @register_policy_loss / @register_kl_estimator "
        "/ @register_loss_aggregation functions (slime.algorithms) become choices of --advantage-estimator, "
        "--loss-type, --kl-loss-type and --loss-agg-mode.",
    )
    group.add_argument(
        "--advantage-estimator",
        choices=algorithms.ADVANTAGE_ESTIMATORS.names(),
        default="grpo",
        help="rloo: leave-one-out baseline; grpo / gspo / cispo / rloo / reinforce_plus_plus_baseline need "
        "--n-samples-per-prompt >= 2.",
    )
    group.add_argument(
        "--loss-type",
        choices=algorithms.loss_type_choices(),
        default="policy_loss",
        help="A registered policy loss (policy_loss = PPO clip, or the estimator's own: gspo, cispo), "
        "sft_loss, or custom_loss (needs --custom-loss-function-path).",
    )
    group.add_argument(
        "--custom-loss-function-path",
        default=None,
        help="f(args, batch, logits, sum_of_sample_mean) -> (loss, metrics) for --loss-type custom_loss.",
    )
    group.add_argument(
        "--custom-advantage-function-path",
        default=None,
        help="f(args, rollout_data) setting 'advantages' and 'returns', replacing the estimator.",
    )
    group.add_argument(
        "--custom-pg-loss-reducer-function-path",
        default=None,
        help="Upstream's pg-loss reducer hook; refused: register a loss aggregation and pick it with --loss-agg-mode.",
    )
    group.add_argument("--eps-clip", type=float, default=0.2, help="Lower PPO clip range.")
    group.add_argument("--eps-clip-high", type=float, default=None, help="Upper PPO clip range (default: --eps-clip).")
    group.add_argument("--eps-clip-c", type=float, default=None, help="Dual-clip bound for negative advantages.")
    group.add_argument("--value-clip", type=float, default=0.2, help="Critic value clip range.")
    group.add_argument("--kl-coef", type=float, default=0.0, help="KL penalty folded into the reward.")
    group.add_argument("--use-kl-loss", action="store_true", help="Add a KL-to-reference term to the loss.")
    group.add_argument("--kl-loss-coef", type=float, default=0.0, help="Weight of the KL loss.")
    group.add_argument(
        "--kl-loss-type",
        choices=algorithms.KL_ESTIMATORS.names(),
        default="k1",
        help="KL estimator of the KL loss and of the --kl-coef reward penalty.",
    )
    group.add_argument(
        "--loss-agg-mode",
        choices=algorithms.LOSS_AGGREGATIONS.names(),
        default=None,
        help="How per-token losses become the step's loss (default: token-mean with --calculate-per-token-loss, "
        "else seq-mean-token-mean). seq-mean-token-sum-norm (Dr. GRPO) divides by --rollout-max-response-len.",
    )
    group.add_argument("--use-unbiased-kl", action="store_true", help="Importance-weight the KL loss.")
    group.add_argument("--entropy-coef", type=float, default=0.0, help="Entropy bonus weight.")
    group.add_argument("--gamma", type=float, default=1.0, help="Discount (ppo, reinforce_plus_plus).")
    group.add_argument("--lambd", type=float, default=1.0, help="GAE lambda (ppo).")
    group.add_argument("--normalize-advantages", action="store_true", help="Whiten advantages over the batch.")
    group.add_argument(
        "--disable-grpo-std-normalization",
        action="store_true",
        help="Only subtract the group mean from rewards (Dr.GRPO).",
    )
    group.add_argument("--disable-rewards-normalization", action="store_true", help="Use raw rewards.")
    group.add_argument(
        "--disable-compute-advantages-and-returns",
        action="store_true",
        help="Do not compute advantages and returns before the loss (SFT: --loss-type sft_loss uses neither).",
    )
    group.add_argument(
        "--use-rollout-logprobs",
        action="store_true",
        help="Use the engines' log-probs as old log-probs instead of recomputing them.",
    )
    group.add_argument("--use-tis", action="store_true", help="Truncated importance sampling on rollout log-probs.")
    group.add_argument("--tis-clip", type=float, default=2.0, help="Upper bound of the TIS weight.")
    group.add_argument("--tis-clip-low", type=float, default=0.0, help="Lower bound of the TIS weight.")
    group.add_argument(
        "--custom-tis-function-path",
        default=None,
        help="f(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths).",
    )
    group.add_argument(
        "--get-mismatch-metrics",
        action="store_true",
        help="Log the train/rollout log-prob gap and train/train_rollout_kl, also under --use-rollout-logprobs "
        "(FSDP only).",
    )
    group.add_argument("--use-opsm", action="store_true", help="Off-policy sequence masking.")
    group.add_argument("--opsm-delta", type=float, default=1e-4, help="OPSM threshold.")
    group.add_argument("--use-routing-replay", action="store_true", help="MoE: replay the old routing in training.")
    group.add_argument(
        "--use-rollout-routing-replay",
        action="store_true",
        help="MoE (R3): engines return the experts each token was routed to and the actor's forwards (log-probs, "
        "training; not the reference) route the same way.",
    )
    group.add_argument("--use-rollout-entropy", action="store_true", help="Log entropy of the rollout policy.")
    group.add_argument("--ref-load", default=None, help="Reference model checkpoint (default: the actor's start).")
    group.add_argument("--ref-ckpt-step", type=int, default=None, help="Step of --ref-load to use.")
    group.add_argument(
        "--ref-update-interval",
        type=int,
        default=None,
        help="Copy the actor's weights into the reference model every this many rollouts. FSDP only.",
    )
    group.add_argument(
        "--num-critic-only-steps", type=int, default=0, help="ppo: train only the critic for the first steps."
    )
    group.add_argument("--megatron-config-path", default=None, help="YAML of Megatron overrides per role.")
    group.add_argument(
        "--reset-optimizer-states",
        action="store_true",
        help="Zero the optimizer's moments and step count after each rollout. FSDP only.",
    )
    group.add_argument("--use-stateless-adam", action="store_true", help="Adam without persistent moments.")


def _add_opd_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("on-policy distillation")
    group.add_argument(
        "--use-opd",
        action="store_true",
        help="On-policy distillation: subtract --opd-kl-coef x (student - teacher log-prob) from the advantage of "
        "every response token (the teacher's log-probs are Sample.teacher_log_probs). Without --rm-type and "
        "--custom-rm-path every reward is 0: pure distillation.",
    )
    group.add_argument(
        "--opd-type",
        choices=["sglang", "megatron"],
        default="sglang",
        help="Where the teacher runs. sglang: an engine (SGLang on GPU, the CPU engine on CPU) at --opd-teacher-url, "
        "or user code sets Sample.teacher_log_probs. megatron: loaded in the trainer (not implemented).",
    )
    group.add_argument(
        "--opd-teacher-url",
        default=None,
        help="Base URL (or /generate URL) of the engine serving the teacher; the default rollout asks it for the "
        "log-prob of every response token. The teacher must share the student's tokenizer.",
    )
    group.add_argument("--opd-kl-coef", type=float, default=1.0, help="Weight of the teacher term.")
    group.add_argument("--opd-teacher-load", default=None, help="Teacher checkpoint (--opd-type megatron).")
    group.add_argument("--opd-teacher-ckpt-step", type=int, default=None, help="Step of the teacher checkpoint.")


def _load_algorithm_modules(args: argparse.Namespace) -> None:
    try:
        algorithms.load_user_registrations(args.custom_algorithm_module)
    except ValueError as e:
        _fail(str(e))


def _estimator(args: argparse.Namespace) -> algorithms.advantages.AdvantageEstimator:
    _load_algorithm_modules(args)
    try:
        return algorithms.ADVANTAGE_ESTIMATORS.get(args.advantage_estimator)
    except ValueError as e:
        _fail(str(e))
