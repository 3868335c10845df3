"""LoRA on the FSDP trainer (`--lora-rank`), in-process on one CPU rank.

The expected values come from an independent peft model of the same base given the same adapter values: its
forward, backward and a torch AdamW step on the same samples. Also: the reference model is the base (the adapter
switched off, no weight copy), and a checkpoint holds the adapter and its optimizer state only, plus a PEFT folder
that peft loads.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import safe_open
from safetensors.torch import load_file
from support.engines import cpu_engine_process, engine_prompt_log_probs
from support.fsdp import CAPTURE_HOOK, CAPTURED, make_args, make_rollout, new_actor, plain_response_log_probs
from support.ranks import spawn_ranks
from support.scripts import run_script
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM

from slime.backends.fsdp_utils import lora
from slime.backends.fsdp_utils.actor import FSDPTrainRayActor
from slime.backends.sglang_utils.http_client import EngineClient
from slime.ray.rollout import split_train_data_by_dp
from slime.utils.arguments import ArgumentValidationError
from slime.utils.http_utils import find_free_port
from slime.utils.lora import POLICY_ADAPTER
from slime.utils.weight_transport import SHARED_MEMORY_FORMAT, deserialize_named_tensors, parse_shared_payload

LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lr", "5e-2"]
SFT = ["--loss-type", "sft_loss"]


pytestmark = pytest.mark.usefixtures("destroy_process_group_after_module")


def adapter_of(actor) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in lora.adapter_tensors(actor.model)}


def peft_reference(model_dir, adapter: dict[str, torch.Tensor]) -> PeftModel:
    """An independent peft model of the base with the given adapter values (PEFT saved names)."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", bias="none"))
    live = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in adapter.items():
            live[name.replace(".weight", ".default.weight")].copy_(value)
    return model


def sft_step(model: PeftModel, optimizer: torch.optim.Optimizer, data: dict, clip_grad: float) -> float:
    """slime's default SFT loss by hand (the mean over samples of each sample's mean response-token NLL), its
    gradient clipped to `clip_grad` (`--clip-grad`), one optimizer step."""
    model.train()
    losses = []
    for tokens, response in zip(data["tokens"], data["response_lengths"]):
        logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float()
        start = len(tokens) - response
        log_probs = torch.log_softmax(logits[start - 1 : len(tokens) - 1], -1)
        losses.append(-log_probs.gather(-1, torch.tensor(tokens[start:])[:, None]).mean())
    loss = torch.stack(losses).mean()
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip_grad)
    optimizer.step()
    return loss.item()


def test_lora_steps_equal_peft_with_torch_adamw(tiny_model_dir):
    args = make_args(tiny_model_dir, *LORA, *SFT)
    actor = new_actor(args)
    trainable = [name for name, p in actor.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    optimized = {id(p) for group in actor.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in actor.model.parameters() if p.requires_grad}  # adapter state only
    base_before = {n: p.detach().clone() for n, p in actor.model.named_parameters() if not p.requires_grad}

    reference = peft_reference(tiny_model_dir, adapter_of(actor))
    optimizer = torch.optim.AdamW(
        [p for p in reference.parameters() if p.requires_grad],
        lr=args.lr,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps,
        weight_decay=args.weight_decay,
    )
    for rollout_id in range(3):  # B starts at 0: the first step moves B only, the later ones A too
        data = make_rollout(8, seed=rollout_id)
        reported = actor.train(rollout_id, data)["train/loss"]
        expected = sft_step(reference, optimizer, data, args.clip_grad)
        assert reported == pytest.approx(expected, abs=1e-5)
    ours = adapter_of(actor)
    theirs = {lora.saved_adapter_name(n): p.detach() for n, p in reference.named_parameters() if p.requires_grad}
    assert ours.keys() == theirs.keys()
    worst = max((ours[name] - theirs[name]).abs().max().item() for name in ours)
    assert worst < 1e-5, worst
    assert min(ours[name].abs().max().item() for name in ours if ".lora_B." in name) > 0  # B trained
    assert all(torch.equal(p, base_before[n]) for n, p in actor.model.named_parameters() if not p.requires_grad)


def test_reference_is_the_base_model_without_a_copy(tiny_model_dir):
    args = make_args(tiny_model_dir, *LORA, "--use-kl-loss", "--rollout-data-postprocess-path", CAPTURE_HOOK)
    actor = new_actor(args, with_ref=True)
    assert actor.ref_weights is None and actor.reference_is_base
    actor.train(200, make_rollout(8, seed=1))
    data = make_rollout(8, seed=2)
    metrics = actor.train(201, data)
    assert metrics["train/kl_loss"] > 0  # the trained adapter moved the policy off the base
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    worst = 0.0
    for tokens, response, ref in zip(data["tokens"], data["response_lengths"], CAPTURED[201]["ref_log_probs"]):
        worst = max(worst, (ref - plain_response_log_probs(plain, tokens, response)).abs().max().item())
    assert worst < 1e-5, worst
    # ...and the adapter is on again for the policy's own log-probs.
    assert not all(torch.equal(a, b) for a, b in zip(CAPTURED[201]["log_probs"], CAPTURED[201]["ref_log_probs"]))


def test_checkpoint_holds_the_adapter_and_resumes_it(tiny_model_dir, tmp_path):
    save = tmp_path / "ckpt"
    actor = new_actor(make_args(tiny_model_dir, *LORA, "--save", str(save)))
    actor.train(0, make_rollout(8, seed=4))
    actor.train(1, make_rollout(8, seed=5))
    actor.save_model(1)
    folder = save / "iter_0000001"
    stored = FileSystemReader(str(folder / "model")).read_metadata().state_dict_metadata
    assert stored and all(".lora_A." in key or ".lora_B." in key for key in stored)  # no base weight
    trained = adapter_of(actor)

    # The PEFT folder loads in peft and computes what the trainer computes.
    config = json.loads((folder / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and "q_proj" in config["target_modules"]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(folder / "adapter")).eval()
    tokens = make_rollout(1, seed=9)["tokens"][0]
    with torch.no_grad():
        ours = actor.model(input_ids=torch.tensor([tokens]), use_cache=False).logits
        theirs = loaded(input_ids=torch.tensor([tokens]), use_cache=False).logits
    assert (ours - theirs).abs().max().item() < 1e-5

    # tools/convert_to_hf.py exports the adapter as a PEFT folder, or merged into the base.
    for merge in ([], ["--merge-lora"]):
        out = tmp_path / f"export{len(merge)}"
        flags = ["--load", str(save), "--hf-checkpoint", str(tiny_model_dir), "--output-dir", str(out), *merge]
        result = run_script("tools/convert_to_hf.py", *flags)
        assert result.returncode == 0, result.stderr[-3000:]
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        exported = (
            AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
            if merge
            else PeftModel.from_pretrained(base, out)
        )
        with torch.no_grad():
            theirs = exported.eval()(input_ids=torch.tensor([tokens]), use_cache=False).logits
        assert (ours - theirs).abs().max().item() < 1e-5
        assert (out / "tokenizer_config.json").is_file() and (out / "adapter_config.json").is_file() != bool(merge)

    # --load restores adapter and optimizer: the next step equals the uninterrupted run's.
    resumed = new_actor(make_args(tiny_model_dir, *LORA, "--load", str(save)))
    assert all(torch.equal(trained[name], value) for name, value in adapter_of(resumed).items())
    data = make_rollout(8, seed=6)
    assert resumed.train(2, data)["train/loss"] == actor.train(2, data)["train/loss"]
    ours, theirs = adapter_of(resumed), adapter_of(actor)
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)

    # --lora-adapter-path warm-starts a new run from the PEFT folder.
    warm = new_actor(make_args(tiny_model_dir, *LORA, "--lora-adapter-path", str(folder / "adapter")))
    assert all(torch.equal(trained[name], value) for name, value in adapter_of(warm).items())
    assert os.path.getsize(folder / "adapter" / "adapter_model.safetensors") < 200_000


def test_target_modules_exclude_modules_and_dropout_shape_the_adapter(tiny_model_dir):
    flags = ["--target-modules", "q_proj", "v_proj", "--exclude-modules", "v_proj", "--lora-dropout", "0.5"]
    actor = new_actor(make_args(tiny_model_dir, *LORA, *flags))
    adapted = {name.split(".lora_")[0].rsplit(".", 1)[-1] for name in adapter_of(actor)}
    assert adapted == {"q_proj"}  # v_proj targeted, then excluded
    config = lora.adapter_config(actor.model)
    assert config["target_modules"] == ["q_proj", "v_proj"] and config["exclude_modules"] == ["v_proj"]
    # Dropout acts on the adapter's input in training only: B must be non-zero for it to show.
    with torch.no_grad():
        for name, param in actor.model.named_parameters():
            if ".lora_B." in name:
                param.normal_()
    tokens = torch.tensor([make_rollout(1, seed=3)["tokens"][0]])

    def logits():
        with torch.no_grad():
            return actor.model(input_ids=tokens, use_cache=False).logits

    actor.model.train()
    assert not torch.equal(logits(), logits())
    actor.model.eval()
    assert torch.equal(logits(), logits())


def _lora_worker(rank: int, world_size: int, port: int, args, shards: list[dict], out_dir: str) -> None:
    actor = FSDPTrainRayActor(world_size, rank, "127.0.0.1", port)
    actor.init(args, "actor", with_ref=True)
    metrics = actor.train(0, shards[rank])
    adapter = adapter_of(actor)  # a collective: every rank gathers
    actor.save_model(0)
    if rank == 0:
        torch.save({"metrics": metrics, "adapter": adapter}, f"{out_dir}/rank0.pt")


def test_world_size_two_trains_and_saves_the_adapter_as_world_size_one(tiny_model_dir, tmp_path):
    """Two FSDP ranks (sharded DTensors, frozen base and adapter in the same units) train the adapter as one rank
    does, and their checkpoint loads at world size one."""
    data = make_rollout(8, seed=8)
    results = {}
    for world_size in (1, 2):
        out = tmp_path / f"ws{world_size}"
        flags = [*LORA, "--use-kl-loss", "--kl-loss-coef", "0.1", "--save", str(out / "save")]
        args = make_args(tiny_model_dir, *flags, "--use-dynamic-batch-size", "--max-tokens-per-gpu", "24")
        per_sample = {key: value for key, value in data.items() if isinstance(value, list)}
        shards = split_train_data_by_dp(args, per_sample, world_size) if world_size > 1 else [data]
        out.mkdir()
        spawn_ranks(_lora_worker, (world_size, find_free_port(), args, shards, str(out)), world_size)
        results[world_size] = torch.load(out / "rank0.pt", weights_only=False)
    single, dual = results[1], results[2]
    for name in ("train/loss", "train/pg_loss", "train/kl_loss"):
        assert dual["metrics"][name] == pytest.approx(single["metrics"][name], abs=1e-5), name
    worst = max((single["adapter"][n] - dual["adapter"][n]).abs().max().item() for n in single["adapter"])
    assert worst < 1e-5, worst
    resumed = new_actor(make_args(tiny_model_dir, *LORA, "--load", str(tmp_path / "ws2" / "save")))
    assert all(torch.equal(value, dual["adapter"][name]) for name, value in adapter_of(resumed).items())


class RecordingClient(EngineClient):
    """A real engine client that also keeps what each adapter load carried, and counts adapter probes."""

    def __init__(self, url: str):
        super().__init__(url)
        self.adapters: list[dict] = []

        self.adapter_probes = 0  # scoring requests under the policy's adapter

    def load_lora_adapter_from_tensors(self, **body):
        self.adapters.append(body)
        return super().load_lora_adapter_from_tensors(**body)

    def load_lora_adapter(self, lora_name: str, lora_path: str):
        self.adapters.append({"lora_name": lora_name, "lora_path": lora_path})
        return super().load_lora_adapter(lora_name, lora_path)

    def generate(self, payload: dict):
        self.adapter_probes += (
            payload.get("lora_path") == POLICY_ADAPTER and payload["sampling_params"].get("max_new_tokens") == 0
        )
        return super().generate(payload)


@pytest.mark.parametrize("transport", ["by-value", "shared-memory", "disk"])
def test_pushes_send_only_the_adapter_which_the_engine_serves(tiny_model_dir, transport, tmp_path):
    """Disaggregated, the adapter goes in the request body, or with --update-weight-transport disk as a PEFT folder
    the engine loads by path; colocated with a CPU engine, through a shared-memory segment the trainer reuses for
    every push (the engine copies the adapter out)."""
    colocate = transport == "shared-memory"
    probe = make_rollout(1, seed=11)["tokens"][0]
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    base = plain_response_log_probs(plain, probe, len(probe) - 1)
    disk_dir = tmp_path / "pushes"
    with cpu_engine_process(tiny_model_dir, "--enable-lora", "--max-lora-rank", "4") as (client, url):
        layout = {"by-value": [], "shared-memory": ["--colocate"]}.get(transport)
        if layout is None:
            layout = ["--update-weight-transport", "disk", "--update-weight-disk-dir", str(disk_dir)]
        actor = new_actor(make_args(tiny_model_dir, *LORA, *SFT, "--check-lora-weight-equal", *layout))
        client = RecordingClient(url)
        actor.connect_rollout_engines([client], [url])
        for version in (1, 2):
            actor.train(version, make_rollout(8, seed=version))
            client.adapter_probes = 0
            actor.update_weights()  # --check-lora-weight-equal: raises past the tolerance
            assert client.adapter_probes == 1  # the trainer probed the adapter after this push
            assert client.get_model_info()["weight_version"] == str(version)
            with torch.no_grad():
                logits = actor.model(input_ids=torch.tensor([probe]), use_cache=False).logits[0, :-1]
            trainer = torch.log_softmax(logits, -1).gather(-1, torch.tensor(probe[1:])[:, None])[:, 0]
            served = engine_prompt_log_probs(client, probe, lora_path=POLICY_ADAPTER)
            assert (served - trainer).abs().max().item() < 1e-4
            assert (served - base).abs().max().item() > 1e-3  # the adapter changes what the engine computes
            assert (engine_prompt_log_probs(client, probe) - base).abs().max().item() < 1e-5  # the base is untouched
        # Each push carried the adapter's tensors only (PEFT names), no base weight.
        assert len(client.adapters) == 2
        if transport == "disk":
            # Each push a PEFT folder named by its version; the first is gone once the engine holds the second.
            first, last = (Path(body["lora_path"]) for body in client.adapters)
            assert first.name.startswith("weights-v1-slime-policy-") and last.name.startswith("weights-v2-")
            assert sorted(p.name for p in disk_dir.iterdir() if not p.name.startswith(".")) == [last.name]
            with safe_open(last / "adapter_model.safetensors", "pt") as saved:
                assert all(torch.equal(saved.get_tensor(n), t) for n, t in adapter_of(actor).items())
                assert set(saved.keys()) == set(adapter_of(actor))
            assert json.loads((last / "adapter_config.json").read_text())["r"] == 4
        else:
            last = client.adapters[-1]["serialized_tensors"]
            if colocate:
                assert [body["load_format"] for body in client.adapters] == [SHARED_MEMORY_FORMAT] * 2
                segments = [parse_shared_payload(body["serialized_tensors"]).segment for body in client.adapters]
                assert segments[0] == segments[1]  # one segment for every push: the engine holds a copy
                pushed = parse_shared_payload(last).tensors
            else:
                assert [body["load_format"] for body in client.adapters] == [None] * 2
                pushed = deserialize_named_tensors(last)
            assert {tensor.name if colocate else tensor[0] for tensor in pushed} == set(adapter_of(actor))
            assert client.adapters[-1]["config_dict"]["r"] == 4 and client.adapters[-1]["lora_name"] == POLICY_ADAPTER

        # An adapter the engine computes differently (here: a config that doubles the scaling) fails the check.
        actor.weight_updater.transport.config["lora_alpha"] = 16
        actor.train(3, make_rollout(8, seed=3))
        with pytest.raises(RuntimeError, match="engine weights differ from the trainer's after update 3"):
            actor.update_weights()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lora-alpha", "8"], None),  # alpha alone is harmless: it has a default
        (["--lora-dropout", "0.1"], "add --lora-rank"),
        (["--lora-rank", "-1"], "must be a positive rank"),
        (["--lora-rank", "4", "--lora-dropout", "1.5"], "must be in [0, 1)"),
        (["--lora-rank", "4", "--target-modules", "all-linear", "q_proj"], "all-linear stands alone"),
        (["--lora-rank", "4", "--lora-adapter-path", "/nonexistent"], "is not a PEFT adapter folder"),
        (["--lora-rank", "4", "--use-kl-loss", "--ref-load", "/x"], "the reference model is the base model"),
        (["--lora-train-only"], "add --lora-rank"),
        (["--lora-rank", "4", "--lora-train-only", "--check-lora-weight-equal"], "has nothing to check"),
        (
            ["--lora-rank", "4", "--multi-lora-n-adapters", "2"],
            "--multi-lora-n-adapters 2 needs each adapter's prompts",
        ),
        (["--lora-rank", "4", "--freeze-params-name-list", "embed"], "drop --freeze-params-name-list"),
        (["--lora-rank", "4", "--debug-rollout-only"], "no trainer to load the adapter"),
    ],
)
def test_lora_flags_are_checked(tiny_model_dir, flags, message):
    if message is None:
        make_args(tiny_model_dir, *flags)
        return
    with pytest.raises(ArgumentValidationError, match=re.escape(message)):
        make_args(tiny_model_dir, *flags)


def test_lora_flags_are_checked_against_the_folders_they_name(tiny_model_dir, tmp_path):
    other_base = tmp_path / "other"
    other_base.mkdir()
    (other_base / "config.json").write_text("{}")
    with pytest.raises(ArgumentValidationError, match="is a HuggingFace folder other than --hf-checkpoint"):
        make_args(tiny_model_dir, *LORA, "--load", str(other_base))
    make_args(tiny_model_dir, *LORA, "--load", str(tiny_model_dir))  # the base itself is fine
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 8, "target_modules": ["q_proj"]}))
    with pytest.raises(ArgumentValidationError) as refused:
        make_args(tiny_model_dir, *LORA, "--target-modules", "v_proj", "--lora-adapter-path", str(adapter))
    assert "--lora-rank 4 (the folder's: 8)" in str(refused.value)
    assert "--target-modules v_proj (the folder's: q_proj)" in str(refused.value)


def test_sglang_gets_the_adapter_in_torchs_own_pickle_and_the_cpu_engine_in_slimes():
    """SGLang reads `serialized_tensors` with an unpickler that admits torch's globals only; the CPU engine's admits
    slime's by-value form only. Each side gets the form it reads, holding the same {name: tensor} dict."""
    import base64
    import pickle

    from slime.backends.weight_sync import LoraAdapterTransport

    tensors = [
        ("base_model.model.q.lora_A.weight", torch.randn(4, 8)),
        ("base_model.model.q.lora_B.weight", torch.zeros(8, 4)),
    ]

    sglang = LoraAdapterTransport({}, "sglang")._payload(tensors)
    decoded = pickle.loads(base64.b64decode(sglang))
    assert {name: value.tolist() for name, value in decoded.items()} == {n: t.tolist() for n, t in tensors}
    assert b"slime" not in base64.b64decode(sglang)  # nothing SGLang's unpickler would refuse
    cpu = LoraAdapterTransport({}, "cpu")._payload(tensors)
    assert [n for n, _ in deserialize_named_tensors(cpu)] == [n for n, _ in tensors]
    assert b"_tensor_from_bytes" in base64.b64decode(cpu)


MULTI = [*LORA, *SFT, "--multi-lora-n-adapters", "2", "--multi-lora-prompt-data", "unused.jsonl", "other.jsonl"]


def adapter_rollout(adapters: list[int], seed: int) -> dict:
    """One global batch of 8 samples per entry of `adapters`, each batch that adapter's."""
    parts = [make_rollout(8, seed=seed + k) for k in range(len(adapters))]
    data = {key: [v for part in parts for v in part[key]] for key, value in parts[0].items() if isinstance(value, list)}
    return data | {"num_steps": len(adapters), "lora_adapters": [a for a in adapters for _ in range(8)]}


def one_adapter(data: dict, adapter: int) -> dict:
    keep = [i for i, a in enumerate(data["lora_adapters"]) if a == adapter]
    return {key: [data[key][i] for i in keep] for key in ("tokens", "response_lengths")}


def test_multi_lora_trains_each_adapter_on_its_own_samples_as_peft_would(tiny_model_dir, tmp_path):
    """--multi-lora-n-adapters 2: an adapter's step equals a one-adapter peft model's torch AdamW step on its samples,
    and leaves the other adapter's parameters and optimizer state as they were; checkpoints hold both."""
    args = make_args(tiny_model_dir, *MULTI, "--save", str(tmp_path / "save"))
    actor = new_actor(args)
    names = ["slime-policy-0", "slime-policy-1"]
    assert list(actor.model.peft_config) == names
    for (optimizer, _), name in zip(actor.adapter_optimizers, names):
        optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
        assert optimized == {id(p) for p in lora.adapter_parameters(actor.model, name)}

    def adapter_values(name: str) -> dict[str, torch.Tensor]:
        prefix = f"{name}/"
        return {n[len(prefix) :]: t.clone() for n, t in lora.adapter_tensors(actor.model) if n.startswith(prefix)}

    def optimizer_state(k: int) -> list[torch.Tensor]:
        state = actor.adapter_optimizers[k][0].state
        return [v.clone() for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)]

    references = []
    for name in names:
        reference = peft_reference(tiny_model_dir, adapter_values(name))
        params = [p for p in reference.parameters() if p.requires_grad]
        references.append((reference, torch.optim.AdamW(params, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps, weight_decay=args.weight_decay)))  # fmt: skip

    # Adapter 1 alone, then adapter 0 alone: the other one's values and optimizer state stay as they were.
    for rollout_id, (trained, idle) in enumerate(((1, 0), (0, 1))):
        before, state_before = adapter_values(names[idle]), optimizer_state(idle)
        data = adapter_rollout([trained], seed=10 * rollout_id)
        metrics = actor.train(rollout_id, data)
        expected = sft_step(*references[trained], one_adapter(data, trained), args.clip_grad)
        assert metrics[f"train/adapter_{trained}/loss"] == pytest.approx(expected, abs=1e-5)
        assert (
            f"train/adapter_{idle}/loss" not in metrics
            and metrics["train/loss"] == metrics[f"train/adapter_{trained}/loss"]
        )
        after = adapter_values(names[idle])
        assert all(torch.equal(before[n], after[n]) for n in before)
        assert len(optimizer_state(idle)) == len(state_before)
        assert all(torch.equal(a, b) for a, b in zip(optimizer_state(idle), state_before))
    # Both in one rollout: each adapter's step is its own peft model's.
    data = adapter_rollout([0, 1], seed=50)
    metrics = actor.train(2, data)
    for k, name in enumerate(names):
        expected = sft_step(*references[k], one_adapter(data, k), args.clip_grad)
        assert metrics[f"train/adapter_{k}/loss"] == pytest.approx(expected, abs=1e-5)
        ours = adapter_values(name)
        theirs = {
            lora.saved_adapter_name(n): p.detach() for n, p in references[k][0].named_parameters() if p.requires_grad
        }
        assert ours.keys() == theirs.keys()
        assert max((ours[n] - theirs[n]).abs().max().item() for n in ours) < 1e-5
    assert not torch.equal(*(next(iter(adapter_values(name).values())) for name in names))  # A starts random in each

    # The checkpoint holds a PEFT folder per adapter; --load resumes both adapters and both optimizers exactly.
    actor.save_model(2)
    folder = tmp_path / "save" / "iter_0000002" / "adapter"
    tokens = torch.tensor([make_rollout(1, seed=9)["tokens"][0]])
    for name in names:
        peft_model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), str(folder / name)
        )
        lora.activate_adapter(actor.model, name)
        with torch.no_grad():
            gap = (actor.model(input_ids=tokens).logits - peft_model.eval()(input_ids=tokens).logits).abs().max()
        assert gap.item() < 1e-5
    resumed = new_actor(make_args(tiny_model_dir, *MULTI, "--load", str(tmp_path / "save")))
    data = adapter_rollout([0, 1], seed=70)
    theirs, ours = actor.train(3, data), resumed.train(3, data)
    assert all(ours[f"train/adapter_{k}/loss"] == theirs[f"train/adapter_{k}/loss"] for k in (0, 1))
    with pytest.raises(ValueError, match="holds 2 LoRA adapter"):
        new_actor(make_args(tiny_model_dir, *LORA, *SFT, "--load", str(tmp_path / "save")))
    # --finetune loads the adapters without their optimizers: the adapter count comes from the model.
    finetuned = new_actor(make_args(tiny_model_dir, *MULTI, "--load", str(tmp_path / "save"), "--finetune"))
    saved = load_file(str(folder / names[1] / "adapter_model.safetensors"))
    loaded = {
        n.removeprefix(f"{names[1]}/"): t for n, t in lora.adapter_tensors(finetuned.model) if n.startswith(names[1])
    }
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[n], saved[n]) for n in saved)
