"""LoRA on the Megatron trainer (`--lora-rank`, `--train-backend megatron`): the actor wired to
slime/backends/megatron_utils/lora.py, on CPU.

One setup serves every test. Megatron actors run in spawned gloo workers (tests/support/megatron_cpu.py): TP=1 on one
rank and TP=2 on two, each from the same PEFT adapter folder (`--lora-adapter-path`, B non-zero, so the policy is
off the base from the first step), training three rollouts with a KL loss against the reference, pushing the adapter
to a CPU engine after rollouts 0 and 1 (TP=1 by value, TP=2 through shared memory), saving after rollout 1 and
resuming from that save to train rollout 2 again. The expected values come from the pytest process: an FSDP LoRA
actor started from the same folder on the same rollouts, the plain HF base model, and peft loading the saved
folders.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, get_peft_model
from support.engines import cpu_engine_process, engine_prompt_log_probs
from support.fsdp import make_rollout, plain_response_log_probs
from support.megatron_cpu import requires_megatron_core, run_in_processes
from support.scripts import run_script
from transformers import AutoModelForCausalLM

from slime.backends.sglang_utils.http_client import EngineClient
from slime.utils.arguments import parse_args
from slime.utils.lora import POLICY_ADAPTER
from slime.utils.weight_transport import SHARED_MEMORY_FORMAT

pytestmark = requires_megatron_core

TOLERANCE = 1e-5
ENGINE_TOLERANCE = 1e-4
ROLLOUTS = 3  # trained in order; the save is after rollout 1, the resumed run trains rollout 2 again
SAVED = 1
PROBE = [5, 17, 42, 99, 123, 7, 250, 31, 64, 12, 200, 3]
COMPARED = ("loss", "pg_loss", "kl_loss", "entropy", "grad_norm")
CAPTURED: dict[int, dict] = {}


def capture(args, rollout_id, data):
    """--rollout-data-postprocess-path hook: the log-probs the trainer computed before its optimizer step."""
    CAPTURED[rollout_id] = {key: list(data[key]) for key in ("log_probs", "ref_log_probs")}


def lora_args(model_dir, backend: str, lora: list[str], *extra: str):
    """The same run for either trainer: GRPO with a KL loss against the reference, and the LoRA flags `lora`."""
    impl = ["--transformer-impl", "local"] if backend == "megatron" else []
    return parse_args(
        ["--train-backend", backend, "--hf-checkpoint", str(model_dir), "--prompt-data", "unused.jsonl",
         "--num-rollout", "4", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
         "--global-batch-size", "8", "--micro-batch-size", "3", "--lr", "2e-2", "--weight-decay", "0",
         "--use-kl-loss", "--kl-loss-coef", "0.5", "--kl-loss-type", "low_var_kl", "--entropy-coef", "0.01",
         "--rollout-data-postprocess-path", f"{__name__}.capture", *lora, *impl, *extra]
    )  # fmt: skip


def rollouts() -> list[dict]:
    return [make_rollout(8, seed=20 + rollout_id) for rollout_id in range(ROLLOUTS)]


def shard(args, data: dict, rank: int, world_size: int) -> dict:
    """This rank's shard, as the driver and RayTrainGroup split a rollout."""
    from slime.ray.actor_group import data_parallel_ranks
    from slime.ray.rollout import split_train_data_by_dp

    dp_ranks = data_parallel_ranks(args, world_size)
    per_sample = {key: value for key, value in data.items() if isinstance(value, list)}
    return split_train_data_by_dp(args, per_sample, max(dp_ranks) + 1)[dp_ranks[rank]] | {"num_steps": 1}


class RecordingClient(EngineClient):
    """A real engine client that also keeps what each adapter load carried."""

    def __init__(self, url: str):
        super().__init__(url)
        self.adapters: list[dict] = []

    def load_lora_adapter_from_tensors(self, **body):
        self.adapters.append(body)
        return super().load_lora_adapter_from_tensors(**body)


# ----------------------------------------------------------------------------------------------
# Megatron side (spawned workers)
# ----------------------------------------------------------------------------------------------


def _probe(actor) -> torch.Tensor:
    from slime.backends.megatron_utils.data import build_step_micro_batches

    steps = build_step_micro_batches([PROBE], [len(PROBE) - 1], 1, 1, None, actor.tp_size, actor.device)
    return actor._forward_log_probs(steps, 1, temperature=1.0)[0]


def _megatron_worker(
    rank: int, world_size: int, model_dir: str, lora: list[str], save: str, url: str, colocate: bool, extra: tuple
) -> dict:
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor

    def new_actor(*flags: str):
        actor = MegatronTrainRayActor(world_size, rank, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        args = lora_args(model_dir, "megatron", lora, *flags, *extra)
        return actor, actor.init(args, "actor", with_ref=True), args

    actor, _, args = new_actor("--save", save, "--save-hf", f"{save}/hf_{{rollout_id}}")
    out: dict = {"ref_weights": actor.ref_weights, "reference_is_base": actor.reference_is_base}
    trainable = [(n, p) for chunk in actor.model for n, p in chunk.named_parameters() if p.requires_grad]
    out["trainable"] = sorted(name for name, _ in trainable)
    optimized = set()  # the model parameters the optimizer steps (the distributed one keeps shards of them)
    for optimizer in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        sharded = getattr(optimizer, "model_param_group_index_map", None)
        optimized |= (
            {id(p) for p in sharded} if sharded else {id(p) for g in optimizer.param_groups for p in g["params"]}
        )
    out["optimizer_holds_the_adapter"] = optimized == {id(p) for _, p in trainable}
    out["base_before"] = actor.hf_weights()

    client = RecordingClient(url)
    actor.args.colocate = colocate  # the transport: shared memory when colocated with a CPU engine, else by value
    actor.connect_rollout_engines([client], [url])
    out["pushes"], out["metrics"] = [], []
    for rollout_id, data in enumerate(rollouts()):
        out["metrics"].append(actor.train(rollout_id, shard(args, data, rank, world_size)))
        if rollout_id <= SAVED:
            actor.update_weights()  # --check-lora-weight-equal: raises past the tolerance
            push = {"trainer": _probe(actor), "check": actor.check_weights_equal()["max_abs_diff"]}
            if rank == 0:
                push["engine"] = engine_prompt_log_probs(client, PROBE, lora_path=POLICY_ADAPTER)
                push["engine_base"] = engine_prompt_log_probs(client, PROBE)
                push["version"] = client.get_model_info()["weight_version"]
            out["pushes"].append(push)
        if rollout_id == SAVED:
            actor.save_model(rollout_id)
            out["saved_adapter"] = dict(actor._adapter_tensors(None))
            out["saved_probe"] = _probe(actor)
        out[f"captured_{rollout_id}"] = CAPTURED[rollout_id]
    out["base_after"] = actor.hf_weights()
    out["adapter_after"] = dict(actor._adapter_tensors(None))
    out["adapter_loads"] = [
        {key: body[key] for key in ("lora_name", "config_dict", "load_format")} for body in client.adapters
    ]

    # --load: the adapter, its optimizer state and the LR schedule of rollout 1; rollout 2 again.
    resumed, start, _ = new_actor("--load", save)
    out["resumed_start"] = start
    out["resumed_adapter"] = dict(resumed._adapter_tensors(None))
    out["resumed_metrics"] = resumed.train(ROLLOUTS - 1, shard(args, rollouts()[-1], rank, world_size))
    out["resumed_adapter_after"] = dict(resumed._adapter_tensors(None))
    return out


# ----------------------------------------------------------------------------------------------
# The setup, and the reference runs in the pytest process
# ----------------------------------------------------------------------------------------------


def make_adapter(model_dir, path) -> str:
    """A PEFT adapter folder for the tiny model with random non-zero A and B (peft's own save_pretrained)."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", bias="none"))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    model.save_pretrained(path)
    return str(path)


def run_fsdp(model_dir, lora: list[str]) -> dict:
    from slime.backends.fsdp_utils.actor import FSDPTrainRayActor
    from slime.backends.fsdp_utils.lora import adapter_tensors

    try:
        actor = FSDPTrainRayActor(1, 0, None, None)
        actor.init(lora_args(model_dir, "fsdp", lora), "actor", with_ref=True)
        metrics = [actor.train(rollout_id, data) for rollout_id, data in enumerate(rollouts())]
        adapter = {name: tensor.clone() for name, tensor in adapter_tensors(actor.model)}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return {"metrics": metrics, "adapter": adapter}


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_lora_actor")
    adapter_dir = make_adapter(tiny_model_dir, root / "start_adapter")
    # Both trainers start from the same adapter folder; after each push the trainer checks the engine against itself.
    lora = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-adapter-path", adapter_dir, "--check-lora-weight-equal"]
    layouts = {}
    with cpu_engine_process(tiny_model_dir, "--enable-lora", "--max-lora-rank", "4") as (_, url):
        # TP=1 pushes by value (disaggregated); TP=2 through shared memory (colocated with the CPU engine), and keeps
        # the adapter's optimizer state in Megatron's distributed optimizer.
        for layout, world_size, colocate, extra in [
            ("tp1", 1, False, ()),
            ("tp2", 2, True, ("--tensor-model-parallel-size", "2", "--use-distributed-optimizer")),
        ]:
            worker_args = (str(tiny_model_dir), lora, str(root / layout), url, colocate, extra)
            layouts[layout] = run_in_processes(_megatron_worker, world_size, args=worker_args)
    fsdp = run_fsdp(tiny_model_dir, lora)
    return root, adapter_dir, layouts, fsdp


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


def _lists_gap(a: list, b: list) -> float:
    return max((torch.as_tensor(x) - torch.as_tensor(y)).abs().max().item() for x, y in zip(a, b, strict=True))


def test_megatron_lora_trains_only_the_adapter_as_fsdp_does(runs):
    _, adapter_dir, layouts, fsdp = runs
    for layout, results in layouts.items():
        for rank, result in enumerate(results):
            # The base is frozen and outside the optimizer: only the adapter's factors train.
            assert result["trainable"] and all(".lora." in name for name in result["trainable"])
            assert len(result["trainable"]) == 2 * 7 * 2  # layers x projections x (A, B)
            assert result["optimizer_holds_the_adapter"]
            assert result["base_before"].keys() == result["base_after"].keys()
            assert all(torch.equal(result["base_after"][n], t) for n, t in result["base_before"].items())
            # Every rollout's step equals FSDP's on the same data, from the same adapter.
            for rollout_id in range(ROLLOUTS):
                for name in COMPARED:
                    ours = result["metrics"][rollout_id][f"train/{name}"]
                    theirs = fsdp["metrics"][rollout_id][f"train/{name}"]
                    print(
                        f"{layout} rank {rank} rollout {rollout_id} train/{name}: megatron {ours:.7f} fsdp {theirs:.7f}"
                    )
                    assert abs(ours - theirs) <= TOLERANCE * max(1.0, abs(theirs)), (layout, rollout_id, name)
            if rank == 0:
                gap = _max_diff(result["adapter_after"], fsdp["adapter"])
                print(f"{layout}: max |megatron adapter - fsdp adapter| after {ROLLOUTS} rollouts = {gap:.2e}")
                assert gap <= TOLERANCE
                start = _max_diff(result["adapter_after"], _folder_tensors(adapter_dir))
                assert start > 1e-3  # the adapter did train
    assert fsdp["metrics"][0]["train/kl_loss"] > 0  # the adapter moves the policy off the base from the start


def _folder_tensors(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "adapter_model.safetensors"))


def test_reference_log_probs_are_the_base_models(tiny_model_dir, runs):
    _, _, layouts, _ = runs
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    data = rollouts()[SAVED]
    expected = [
        plain_response_log_probs(plain, tokens, response)
        for tokens, response in zip(data["tokens"], data["response_lengths"], strict=True)
    ]
    for layout, results in layouts.items():
        result = results[0]
        assert result["ref_weights"] is None and result["reference_is_base"]  # no reference copy
        captured = result[f"captured_{SAVED}"]
        gap = _lists_gap(captured["ref_log_probs"], expected)
        print(f"{layout}: max |reference log-probs - HF base| = {gap:.2e}")
        assert gap <= TOLERANCE
        assert _lists_gap(captured["log_probs"], captured["ref_log_probs"]) > 1e-3  # the adapter is on again


def test_pushed_adapter_is_what_the_engine_serves(tiny_model_dir, runs):
    _, _, layouts, _ = runs
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    base = plain_response_log_probs(plain, PROBE, len(PROBE) - 1)
    for layout, results in layouts.items():
        pushes = results[0]["pushes"]
        for version, push in enumerate(pushes, start=1):
            gap = (push["engine"] - push["trainer"]).abs().max().item()
            print(f"{layout} push {version}: max |engine under the adapter - trainer| = {gap:.2e}")
            assert gap <= ENGINE_TOLERANCE and push["check"] <= ENGINE_TOLERANCE
            assert (push["engine"] - base).abs().max().item() > 1e-3  # the engine serves the adapter ...
            assert (push["engine_base"] - base).abs().max().item() < 1e-5  # ... on the base it loaded
            assert push["version"] == str(version)
        assert (pushes[1]["trainer"] - pushes[0]["trainer"]).abs().max().item() > 1e-3  # training moved it
        loads = results[0]["adapter_loads"]
        assert len(loads) == len(pushes)  # one adapter load per push, nothing else
        colocated = layout == "tp2"
        assert {load["load_format"] for load in loads} == {SHARED_MEMORY_FORMAT if colocated else None}
        config = loads[-1]["config_dict"]
        assert loads[-1]["lora_name"] == POLICY_ADAPTER and config["r"] == 4 and config["lora_alpha"] == 8
        assert sorted(config["target_modules"]) == sorted(
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        )
        assert all(not result["adapter_loads"] for result in results[1:])  # rank 0 alone posts


def test_checkpoint_resumes_exactly_and_holds_a_peft_folder(tiny_model_dir, runs, tmp_path):
    root, _, layouts, _ = runs
    for layout, results in layouts.items():
        for result in results:
            # --load: the next step's loss and the adapter are the uninterrupted run's, bit for bit.
            assert result["resumed_start"] == SAVED + 1
            assert _max_diff(result["resumed_adapter"], result["saved_adapter"]) == 0.0
            for name, value in result["metrics"][-1].items():
                if name.startswith("train/") and not name.endswith(("_time", "tokens_per_s")):
                    assert result["resumed_metrics"][name] == value, (layout, name)
            assert _max_diff(result["resumed_adapter_after"], result["adapter_after"]) == 0.0

        saved = results[0]
        folder = root / layout / f"iter_{SAVED:07d}"
        assert (folder / "adapter" / "adapter_model.safetensors").is_file()
        assert _max_diff(_folder_tensors(folder / "adapter"), saved["saved_adapter"]) == 0.0
        assert _max_diff(_folder_tensors(root / layout / f"hf_{SAVED}"), saved["saved_adapter"]) == 0.0
        config = json.loads((folder / "adapter" / "adapter_config.json").read_text())
        assert config["r"] == 4 and config["lora_alpha"] == 8
        # peft loads the folder onto the base and computes what the trainer computed at the save.
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        loaded = PeftModel.from_pretrained(base, str(folder / "adapter")).eval()
        gap = (plain_response_log_probs(loaded, PROBE, len(PROBE) - 1) - saved["saved_probe"]).abs().max().item()
        print(f"{layout}: max |peft(saved adapter folder) - megatron trainer| probe log-prob = {gap:.2e}")
        assert gap <= TOLERANCE

    # tools/convert_to_hf.py exports a Megatron LoRA checkpoint as a PEFT folder, or merged into the base.
    saved = layouts["tp1"][0]
    for merge in ([], ["--merge-lora"]):
        out = tmp_path / f"export{len(merge)}"
        flags = ["--load", str(root / "tp1"), "--ckpt-step", str(SAVED), "--hf-checkpoint", str(tiny_model_dir)]
        result = run_script("tools/convert_to_hf.py", *flags, "--output-dir", str(out), *merge)
        assert result.returncode == 0, result.stderr[-3000:]
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        exported = AutoModelForCausalLM.from_pretrained(out) if merge else PeftModel.from_pretrained(base, str(out))
        log_probs = plain_response_log_probs(exported.float().eval(), PROBE, len(PROBE) - 1)
        assert (log_probs - saved["saved_probe"]).abs().max().item() <= TOLERANCE
        assert (out / "adapter_config.json").is_file() != bool(merge)


@pytest.mark.reliability(
    "a LoRA run's Megatron checkpoint loaded as a full model",
    "refused before loading, naming --lora-rank and the merge",
)
def test_a_lora_checkpoint_is_not_loaded_as_a_full_model(runs):
    from slime.backends.megatron_utils.checkpoint import load_checkpoint

    root = runs[0]
    with pytest.raises(ValueError, match=r"holds only a LoRA adapter .* tools/convert_to_hf.py --merge-lora"):
        load_checkpoint(root / "tp1", [])
