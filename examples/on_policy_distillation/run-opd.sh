#!/usr/bin/env bash
# On-policy distillation (examples/on_policy_distillation/README.md): the student generates, a teacher engine
# scores every response token, and the student is trained on -(log p_student - log p_teacher) per token.
# TEACHER=<HF folder>: this script serves it with slime's CPU engine; TEACHER_URL=http://HOST:PORT: a teacher
# already served (SGLang on GPU). By default the CPU quickstart's model as the student and its addition set;
# MODEL=... DATA=... pick others, and any extra flags go to train.py (GPU flags included).
set -euo pipefail
cd "$(dirname "$0")/../.."

MODEL=${MODEL:-models/SmolLM2-135M-Instruct}
DATA=${DATA:-data/addition/train.jsonl}
OUT=${OUT:-outputs/opd}
TEACHER=${TEACHER:-}
TEACHER_URL=${TEACHER_URL:-}
for path in "$MODEL" "$DATA"; do
    if [ ! -e "$path" ]; then
        echo "$path does not exist: run bash scripts/run-quickstart-cpu.sh once (it prepares both), or pass MODEL=... DATA=..." >&2
        exit 1
    fi
done

if [ -z "$TEACHER_URL" ]; then
    if [ -z "$TEACHER" ] || [ ! -d "$TEACHER" ]; then
        echo "set TEACHER=<HF folder of the teacher> (served here by the CPU engine) or TEACHER_URL=http://HOST:PORT" \
             "(an engine already serving it, e.g. python -m sglang.launch_server --model-path <teacher>); the teacher" \
             "must share the student's tokenizer" >&2
        exit 1
    fi
    PORT=${TEACHER_PORT:-$(python3 -c "from slime.utils.http_utils import find_free_port; print(find_free_port())")}
    mkdir -p "$OUT"
    python3 -m slime.backends.cpu_engine --model-path "$TEACHER" --port "$PORT" --num-threads 1 >"$OUT/teacher.log" 2>&1 &
    TEACHER_PID=$!
    trap 'kill "$TEACHER_PID" 2>/dev/null || true' EXIT
    TEACHER_URL="http://127.0.0.1:$PORT"
    python3 -c "from slime.utils.http_utils import wait_until_healthy as w; w('$TEACHER_URL/health', 300, log_path='$OUT/teacher.log')"
fi

ARGS=(
    --hf-checkpoint "$MODEL"
    --prompt-data "$DATA" --input-key prompt --label-key label --apply-chat-template --rollout-shuffle
    # No --rm-type: pure distillation, every reward is 0 and the teacher term is the whole signal. Add a
    # --rm-type (e.g. last_number) to train on the task reward and the teacher term together.
    --use-opd --opd-type sglang --opd-teacher-url "$TEACHER_URL" --opd-kl-coef "${KL_COEF:-1.0}"
    --rollout-batch-size 8 --n-samples-per-prompt 4 --num-rollout "${NUM_ROLLOUT:-20}"
    --rollout-max-response-len 32 --rollout-temperature 1.0
    --advantage-estimator grpo --lr 2e-5
    --save "$OUT" --save-interval 10 --save-debug-rollout-data "$OUT/rollouts/rollout_{rollout_id}.pt"
)
python3 train.py "${ARGS[@]}" "$@"
