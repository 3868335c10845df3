"""The documentation site (docs/, mkdocs.yml): it builds in strict mode, its generated pages are current, the
flag reference lists every registered flag, and every snippet of docs/extending.md runs through the slime code
that calls it (real parser, real data source, real CPU engine and sglang-router for the rollout ones)."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest
import torch
import yaml
from support.engines import engine_server, router_args, router_for
from support.flags import slime_flags
from transformers import AutoTokenizer

from slime.utils.arguments import build_parser, parse_args
from slime.utils.run_context import RunContext, expose_to_plugins
from slime.utils.types import Sample, Status

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
SNIPPETS = DOCS / "snippets"
FLAGS_PAGE = DOCS / "reference" / "flags.md"
ENV = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "--site-dir", str(site)]
    return subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)


def nav_pages(nav) -> list[str]:
    """Every page path in mkdocs.yml's nav."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in nav_pages(value)]
    return [page for item in nav for page in nav_pages(item)]


# ---- the site ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_site_builds_strictly_with_every_page(tmp_path):
    result = mkdocs_build(REPO / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    pages = nav_pages(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"])
    on_disk = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(pages) == on_disk, "every page under docs/ is in the nav, and every nav entry exists"
    for page in pages:
        built = page.removesuffix(".md").removesuffix("index").strip("/")
        assert (tmp_path / "site" / built / "index.html").is_file(), f"{page} was not built"
    # The snippets were included, not left as markers.
    extending = re.sub(r"<[^>]+>", "", (tmp_path / "site" / "extending" / "index.html").read_text())
    assert "clipped_grpo" in extending and "class AdditionSource" in extending and "--8&lt;--" not in extending


@pytest.mark.slow
@pytest.mark.reliability(
    "a docs page linking to a missing page and to a flag anchor that does not exist",
    "the strict docs build fails naming both",
)
def test_strict_build_fails_on_a_broken_link_or_flag_anchor(tmp_path):
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(DOCS, tmp_path / "docs")
    faq = tmp_path / "docs" / "faq.md"
    faq.write_text(faq.read_text() + "\n[gone](no-such-page.md), [flag](reference/flags.md#--no-such-flag)\n")
    result = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "no-such-page.md" in output and "--no-such-flag" in output


# ---- generated pages -----------------------------------------------------------------------------------------
def load_generator():
    spec = importlib.util.spec_from_file_location("gen_docs", REPO / "tools" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_pages_are_current():
    # A fresh process: the page must not depend on what other tests registered or on this machine's CUDA.
    result = subprocess.run(
        [sys.executable, "tools/gen_docs.py", "--check"], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr


def test_a_hand_edited_generated_page_is_reported(tmp_path):
    shutil.copytree(DOCS, tmp_path / "docs")
    page = tmp_path / "docs" / "examples" / "retool.md"
    page.write_text(page.read_text() + "\nan edit by hand\n")
    stale = load_generator().stale_pages(tmp_path / "docs")
    assert "examples/retool.md" in stale and "examples/search-r1.md" not in stale


def test_example_pages_are_the_readmes_with_links_for_the_site():
    readmes = sorted((REPO / "examples").glob("*/README.md"))
    assert readmes, "no example READMEs found"
    index = (DOCS / "examples" / "index.md").read_text()
    for readme in readmes:
        copy = DOCS / "examples" / f"{readme.parent.name}.md"
        assert copy.is_file(), f"{readme} has no docs page"
        body = readme.read_text()
        # Same text apart from the header comment and rewritten links.
        assert copy.read_text().splitlines()[1:3] == body.splitlines()[:2]
        if f"]({readme.parent.name}/README.md)" in (REPO / "examples" / "README.md").read_text():
            assert f"]({readme.parent.name}.md)" in index


def unescape(markdown: str) -> str:
    """The plain text of a flag reference cell."""
    text = re.sub(r"(?<!\\)\*+", "", markdown)  # emphasis markers, not the escaped stars of the help text
    return re.sub(r"\\(.)", r"\1", text).replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")


def documented_rows() -> dict[str, tuple[str, str, str]]:
    """option string -> (invocation, default cell, description) of every row of the flag reference."""
    rows = {}
    pattern = re.compile(r'^\| <a id="([^"]+)"></a>`((?:[^`\\]|\\.)+)` \| (.*?) \| (.*) \|$')
    for line in FLAGS_PAGE.read_text().splitlines():
        match = pattern.match(line)
        if match:
            invocation = match.group(2).replace("\\|", "|")
            for part in invocation.split(", "):
                rows[part.split(" ")[0]] = (invocation, match.group(3), match.group(4))
    return rows


def registered_actions() -> dict[str, argparse.Action]:
    """option string -> action, for every flag either backend's parser registers, without the --sglang-<field>
    flags an installed SGLang adds (the page leaves those out: they follow the SGLang version)."""
    from slime.utils import arguments

    sglang = {
        "sglang_" + a.dest
        for a in arguments._forwarded_actions(arguments._sglang_source_parser(), arguments._SGLANG_EXCLUDED)
    }
    found = {}
    for backend in ("megatron", "fsdp"):
        for action in build_parser(backend)._actions:
            if action.dest not in sglang:
                for option in action.option_strings:
                    found.setdefault(option, action)
    return found


def test_flag_reference_lists_every_registered_flag():
    documented, registered = documented_rows(), registered_actions()
    assert len(registered) > 300
    assert sorted(set(registered) - set(documented)) == [], "registered flags missing from docs/reference/flags.md"
    assert sorted(set(documented) - set(registered)) == [], "docs/reference/flags.md lists flags that do not exist"


def test_flag_reference_rows_give_help_default_and_refusal():
    from slime.utils.arguments import REFUSED_FLAGS

    documented = documented_rows()
    for option, action in registered_actions().items():
        _, default_cell, description = documented[option]
        text = " ".join(unescape(description).split())
        if action.help:
            help_text = " ".join((action.help % {**vars(action), "prog": "x"}).split())
            assert help_text.rstrip(".") in text, f"{option}: help text missing"
        refusal = REFUSED_FLAGS.get(action.dest)
        if refusal is None:
            assert "Refused" not in text, f"{option} is not refused"
        else:
            assert "Refused" in text and refusal.reason in text and refusal.instead in text, f"{option}: refusal"
        if not torch.cuda.is_available() and action.default is not argparse.SUPPRESS:
            shown = default_cell.strip("`")
            expected = action.default if isinstance(action.default, str) else repr(action.default)
            assert shown == (expected or '""'), f"{option}: default {shown} != {expected}"


# ---- snippets without an engine ------------------------------------------------------------------------------
@pytest.fixture
def snippets(monkeypatch):
    monkeypatch.syspath_prepend(str(SNIPPETS))


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = [{"prompt": f"What is {i} + {i}? Reply with only the number.", "label": str(2 * i)} for i in range(12)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def base_flags(model_dir, prompts: Path) -> list[str]:
    return [
        "--hf-checkpoint", str(model_dir), "--prompt-data", str(prompts), "--input-key", "prompt", "--label-key",
        "label", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1",
    ]  # fmt: skip


def answered(index: int, group: int, response: str, label: str, status=Status.COMPLETED, length=None) -> Sample:
    length = len(response.split()) if length is None else length
    return Sample(
        index=index,
        group_index=group,
        prompt="q",
        tokens=list(range(3 + length)),
        response=response,
        response_length=length,
        label=label,
        status=status,
    )


def test_reward_snippets_through_the_reward_hub(snippets):
    from slime.rollout.rm_hub import async_rm, batched_async_rm

    args = slime_flags(custom_rm_path="my_reward.exact_number", group_rm=False)
    cases = [("the sum is 12", "12", 1.0), ("12 or 13", "12", 0.0), ("no idea", "4", 0.0), ("-3", "-3", 1.0)]
    for response, label, expected in cases:
        assert asyncio.run(async_rm(args, answered(0, 0, response, label))) == expected

    group = [
        answered(0, 0, "it is 12", "12", length=3),
        answered(1, 0, "12", "12", length=1),
        answered(2, 0, "11", "12", length=1),
    ]
    args = slime_flags(custom_rm_path="my_reward.shortest_correct_bonus", group_rm=True)
    assert asyncio.run(batched_async_rm(args, group)) == [1.0, 1.5, 0.0]


def test_filter_snippets_and_the_buffer_filter_in_the_data_source(snippets, tiny_model_dir, prompts_file):
    from my_filters import drop_truncated_groups

    from slime.rollout.data_source import RolloutDataSourceWithBuffer

    kept = drop_truncated_groups(None, [answered(0, 0, "1", "1"), answered(1, 0, "2", "1")])
    dropped = drop_truncated_groups(None, [answered(0, 0, "1", "1"), answered(1, 0, "2", "1", Status.TRUNCATED)])
    assert kept.keep and not dropped.keep and dropped.reason == "1 of 2 responses truncated"

    args = parse_args([*base_flags(tiny_model_dir, prompts_file), "--buffer-filter-path", "my_filters.newest_first"])
    source = RolloutDataSourceWithBuffer(args)
    first, second, third = source.get_samples(3)
    source.add_samples([first, second, third])
    served = source.get_samples(2)
    assert [g[0].group_index for g in served] == [third[0].group_index, second[0].group_index]
    assert [g[0].group_index for g in source.buffer] == [first[0].group_index]
    # The buffer holds one group; the second comes from the dataset, after the three drawn before.
    fourth_prompt = "What is 3 + 3? Reply with only the number."
    assert [g[0].prompt for g in source.get_samples(2)] == [first[0].prompt, fourth_prompt]


def test_data_source_snippet_saves_and_resumes(snippets, tiny_model_dir, tmp_path):
    from my_data_source import AdditionSource

    flags = ["--hf-checkpoint", str(tiny_model_dir), "--data-source-path", "my_data_source.AdditionSource"]
    flags += "--rollout-batch-size 2 --n-samples-per-prompt 2 --num-rollout 3 --rm-type last_number".split()
    args = parse_args([*flags, "--save", str(tmp_path / "run")])  # no --prompt-data: the class brings its prompts
    source = AdditionSource(args)
    groups = source.get_samples(3)
    assert [[s.index for s in g] for g in groups] == [[0, 1], [2, 3], [4, 5]]
    for group in groups:
        a, b = map(int, re.findall(r"\d+", group[0].prompt))
        assert all(s.label == str(a + b) and s.prompt == group[0].prompt for s in group)
    source.add_samples([groups[1]])
    source.save(0)

    resumed = AdditionSource(argparse.Namespace(**{**vars(args), "load": args.save}))
    resumed.load(0)
    assert [s.prompt for s in resumed.get_samples(2)[0]] == [s.prompt for s in groups[1]]  # the put-back group
    assert resumed.get_samples(1)[0][0].group_index == 4  # then new groups, after the ones handed out before


def test_eval_config_snippet_is_a_valid_eval_config(tiny_model_dir, prompts_file):
    from slime.utils.eval_config import eval_datasets

    flags = [*base_flags(tiny_model_dir, prompts_file), "--eval-config", str(SNIPPETS / "eval_config.yaml")]
    datasets = {d.name: d for d in eval_datasets(parse_args([*flags, "--eval-interval", "1"]))}
    assert datasets["addition"].n_samples_per_eval_prompt == 4 and datasets["addition"].temperature == 0.6
    greedy = datasets["addition_greedy"]
    assert (greedy.n_samples_per_eval_prompt, greedy.temperature, greedy.max_response_len) == (1, 0.0, 64)
    assert greedy.rm_type == "last_number" and greedy.metadata_overrides == {"split": "greedy"}


def test_rollout_side_hooks_through_the_train_data_conversion(snippets, tiny_model_dir, prompts_file):
    import my_hooks

    from slime.ray.rollout import convert_samples_to_train_data

    args = parse_args(base_flags(tiny_model_dir, prompts_file))
    samples = [answered(i, i // 2, "x", "1", length=2 + i) for i in range(4)]
    for sample, reward in zip(samples, [1.0, 0.0, 0.0, 0.0]):
        sample.reward = reward
    args.custom_reward_post_process_path = "my_hooks.reward_post_process"
    data = convert_samples_to_train_data(args, samples)
    assert data["raw_reward"] == [1.0, 0.0, 0.0, 0.0] and data["rewards"] == [0.75, -0.25, -0.25, -0.25]

    args.custom_convert_samples_to_train_data_path = "my_hooks.convert_samples_to_train_data"
    data = convert_samples_to_train_data(args, samples)
    assert data["response_lengths"] == [2, 3, 4, 5] and data["loss_masks"][3] == [1] * 5

    groups = [[answered(0, 0, "", "1", length=0), answered(1, 0, "a b", "1")]]
    my_hooks.rollout_sample_filter(args, groups)
    assert [s.remove_sample for s in groups[0]] == [True, False]
    hooked = asyncio.run(my_hooks.rollout_sample_hook(args, groups[0][1], rollout_id=0, evaluation=False))
    assert hooked is None and groups[0][1].metadata["response_chars"] == 3
    assert my_hooks.rollout_log(0, args, samples, {}, 1.0) is False
    assert my_hooks.eval_rollout_log(0, args, {"addition": {"rewards": [1.0], "truncated": [False]}}, {}) is False


def test_trainer_hooks_through_the_trainer_code(snippets, tiny_model_dir, prompts_file):
    import my_hooks

    from slime.algorithms.advantages import compute_advantages_and_returns
    from slime.algorithms.aggregation import StepNormalizer
    from slime.algorithms.losses import policy_loss_from_log_probs
    from slime.backends.fsdp_utils.loss import custom_loss

    args = parse_args(base_flags(tiny_model_dir, prompts_file))
    masks = [torch.tensor([1, 1, 0]), torch.tensor([1, 1])]
    args.custom_advantage_function_path = "my_hooks.custom_advantages"
    data = {"rewards": [0.5, -1.0], "loss_masks": masks}
    compute_advantages_and_returns(args, data)
    assert [a.tolist() for a in data["advantages"]] == [[0.5, 0.5, 0.5], [-1.0, -1.0]]
    data["advantages"] = [torch.tensor([9.0, -9.0, 1.0]), torch.tensor([2.0, 3.0])]
    my_hooks.rollout_data_postprocess(args, 0, data)
    assert [a.tolist() for a in data["advantages"]] == [[5.0, -5.0, 1.0], [2.0, 3.0]]

    # The custom loss, through the FSDP trainer's loss: seq-mean-token-mean over 2 samples.
    logits = torch.tensor([[0.0, 1.0], [2.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 3.0]])
    targets = torch.tensor([1, 0, 1, 0, 1])
    batch = {
        "target_tokens": targets,
        "response_lengths": [3, 2],
        "loss_masks": masks,
        "advantages": data["advantages"],
    }
    args.custom_loss_function_path = "my_hooks.reinforce_loss"
    loss, metrics = custom_loss(args, batch, logits, StepNormalizer(num_samples=2, num_tokens=4))
    log_p = [math.log(math.exp(row[t]) / sum(math.exp(v) for v in row)) for row, t in zip(logits.tolist(), targets)]
    sample_0 = (-log_p[0] * 5.0 + -log_p[1] * -5.0) / 2
    sample_1 = (-log_p[3] * 2.0 + -log_p[4] * 3.0) / 2
    assert loss.item() == pytest.approx((sample_0 + sample_1) / 2, rel=1e-6)
    assert metrics["reinforce_loss"].item() == pytest.approx(loss.item())

    # The TIS function, through the policy loss: PPO clip at ratio 1 (log_probs == old), times min(w, 2).
    args.use_tis, args.custom_tis_function_path = True, "my_hooks.capped_tis"
    old = [torch.zeros(3), torch.zeros(2)]
    rollout = [torch.tensor([0.0, -1.0, 0.0]), torch.tensor([-0.5, 0.0])]
    batch = {"log_probs": old, "advantages": [torch.ones(3), torch.ones(2)], "loss_masks": masks,
             "rollout_log_probs": rollout, "response_lengths": [3, 2], "total_lengths": [5, 4]}  # fmt: skip
    loss, metrics = policy_loss_from_log_probs(
        args, batch, torch.zeros(5), torch.zeros(5), StepNormalizer(num_samples=2, num_tokens=4)
    )
    weights = [1.0, min(math.e, 2.0), 1.0, math.exp(0.5), 1.0]
    expected = ((-weights[0] - weights[1]) / 2 + (-weights[3] - weights[4]) / 2) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["tis_weight_mean"].item() == pytest.approx((1.0 + 2.0 + math.exp(0.5) + 1.0) / 4, rel=1e-6)

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    my_hooks.before_train_step(args, 0, 0, model, optimizer, None)


ALGORITHMS_SCRIPT = """
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from slime.algorithms.advantages import compute_advantages_and_returns, group_baseline_rewards
from slime.algorithms.aggregation import StepNormalizer
from slime.algorithms.losses import policy_loss_from_log_probs
from slime.utils.arguments import parse_args

args = parse_args(json.loads(sys.argv[2]))
raw = [1.0] + [0.0] * 7
masks = [torch.tensor([1, 1])] + [torch.tensor([1])] * 7
data = {"rewards": group_baseline_rewards(args, raw), "loss_masks": masks}
compute_advantages_and_returns(args, data)
batch = {
    "log_probs": [torch.tensor([0.0, 0.0]), torch.tensor([0.0])],
    "advantages": [torch.tensor([2.0, 2.0]), torch.tensor([-1.0])],
    "ref_log_probs": [torch.tensor([0.0, 4.0]), torch.tensor([0.0])],
    "loss_masks": [torch.tensor([1, 1]), torch.tensor([1])],
    "response_lengths": [2, 1],
}
current = torch.tensor([0.5, -0.1, 0.2])
loss, metrics = policy_loss_from_log_probs(args, batch, current, torch.zeros(3), StepNormalizer.from_args(args, 2, 3))
print(json.dumps({
    "rewards": [float(r) for r in data["rewards"]],
    "advantages": [a.tolist() for a in data["advantages"]],
    "loss": loss.item(), "pg_loss": metrics["pg_loss"].item(), "kl_loss": metrics["kl_loss"].item(),
}))
"""


def test_algorithm_snippets_become_flag_values_and_compute_as_documented(tiny_model_dir, prompts_file):
    flags = (
        base_flags(tiny_model_dir, prompts_file)
        + (
            "--n-samples-per-prompt 8 --rollout-batch-size 1 --custom-algorithm-module my_algorithms "
            "--advantage-estimator clipped_grpo --loss-type capped_ratio_pg --use-kl-loss --kl-loss-coef 0.1 "
            "--kl-loss-type k2_clamped --loss-agg-mode seq-mean-token-sqrt --eps-clip 0.2"
        ).split()
    )
    # In a fresh process: registering names here would change the registries other tests read.
    result = subprocess.run(
        [sys.executable, "-c", ALGORITHMS_SCRIPT, str(SNIPPETS), json.dumps(flags)],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    # GRPO's group baseline makes the one correct answer of 8 stand out by more than 2: the estimator clips it.
    assert out["rewards"][0] > 2.0 and -2.0 < out["rewards"][1] < 0
    assert out["advantages"][0] == [2.0, 2.0]
    assert all(a == [pytest.approx(out["rewards"][1])] for a in out["advantages"][1:])
    # Per-token losses -A * min(ratio, 1.2), then each sample's sum over sqrt(its tokens), over 2 samples.
    ratios = [min(math.exp(0.5), 1.2), math.exp(-0.1), min(math.exp(0.2), 1.2)]
    pg = ((-2.0 * ratios[0] - 2.0 * ratios[1]) / math.sqrt(2) + (1.0 * ratios[2]) / 1.0) / 2
    # k2_clamped: 0.5 * (log pi - log ref)^2, clamped to 5: tokens 0.125, min(8.405, 5), 0.02.
    kl = ((0.5 * 0.25 + 5.0) / math.sqrt(2) + 0.5 * 0.04) / 2
    assert out["pg_loss"] == pytest.approx(pg, rel=1e-5)
    assert out["kl_loss"] == pytest.approx(kl, rel=1e-5)
    assert out["loss"] == pytest.approx(pg + 0.1 * kl, rel=1e-5)


# ---- snippets against a real CPU engine behind sglang-router -------------------------------------------------
@pytest.fixture(scope="module")
def serving(tiny_model_dir, tmp_path_factory):
    """(engine URL, router URL): one CPU engine on the tiny model, registered with a real sglang-router."""
    with engine_server(tiny_model_dir, "--context-length", "1024") as (_, engine_url):
        with router_for([engine_url], router_args(tmp_path_factory.mktemp("router_logs"))) as router_url:
            yield engine_url, router_url


def rollout_args(model_dir, prompts: Path, serving, *extra: str) -> argparse.Namespace:
    """Parsed flags, with the addresses the rollout manager would set."""
    # Half the vocabulary stops a response: short answers, some of them cut at --rollout-max-response-len.
    stop_ids = [str(i) for i in range(0, 320, 2)]
    flags = [*base_flags(model_dir, prompts), "--rollout-max-response-len", "4", "--rollout-stop-token-ids", *stop_ids]
    args = parse_args([*flags, *extra])
    engine_url, router_url = serving
    router = urlparse(router_url)
    context = RunContext(router_host=router.hostname, router_port=router.port, engine_urls_source=lambda: [engine_url])
    expose_to_plugins(args, context)
    return args


def default_rollout(args, data_source):
    """The default rollout function with a fresh per-process state (it caches the hooks of the first args)."""
    from slime.rollout import sglang_rollout

    sglang_rollout._STATE = None
    return sglang_rollout.generate_rollout(args, 0, data_source)


@pytest.mark.slow
def test_reward_filter_and_hook_snippets_in_the_default_rollout(
    snippets, tiny_model_dir, prompts_file, serving, caplog
):
    from my_reward import _last_number

    from slime.rollout.data_source import RolloutDataSourceWithBuffer

    args = rollout_args(
        tiny_model_dir, prompts_file, serving,
        "--custom-rm-path", "my_reward.exact_number",
        "--dynamic-sampling-filter-path", "my_filters.drop_truncated_groups",
        "--rollout-sample-hook-path", "my_hooks.rollout_sample_hook",
        "--rollout-sample-filter-path", "my_hooks.rollout_sample_filter",
        "--rollout-all-samples-process-path", "my_hooks.rollout_all_samples_process",
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="my_hooks"):
        output = default_rollout(args, RolloutDataSourceWithBuffer(args))
    assert len(output.samples) == 2 and all(len(group) == 2 for group in output.samples)
    for sample in (s for group in output.samples for s in group):
        assert sample.status == Status.COMPLETED  # the filter let no truncated group through
        assert sample.reward == float(_last_number(sample.response) == sample.label)
        assert sample.metadata["response_chars"] == len(sample.response)
        assert sample.remove_sample == (sample.response_length == 0)
    seen = [int(m.group(1)) for m in re.finditer(r"(\d+) groups finished this rollout", caplog.text)]
    assert seen == [2 + int(output.metrics["rollout/dropped_groups"])]


@pytest.mark.slow
def test_generate_snippet_builds_a_masked_multi_turn_sample(snippets, tiny_model_dir, prompts_file, serving):
    from my_generate import REMINDER

    from slime.rollout.data_source import RolloutDataSourceWithBuffer

    args = rollout_args(
        tiny_model_dir, prompts_file, serving,
        "--custom-generate-function-path", "my_generate.generate", "--max-turns", "3", "--rm-type", "last_number",
    )  # fmt: skip
    output = default_rollout(args, RolloutDataSourceWithBuffer(args))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    reminder_ids = tokenizer(REMINDER, add_special_tokens=False)["input_ids"]
    for sample in (s for group in output.samples for s in group):
        response = sample.tokens[len(sample.tokens) - sample.response_length :]
        assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length > 0
        masked = [t for t, m in zip(response, sample.loss_mask) if m == 0]
        turns = 1 + len(masked) // len(reminder_ids)
        assert masked == reminder_ids * (turns - 1) and turns <= 3  # only the reminders are masked
        assert all(lp == 0.0 for lp, m in zip(sample.rollout_log_probs, sample.loss_mask) if m == 0)
        assert sample.reward in (0.0, 1.0)


@pytest.mark.slow
def test_rollout_function_snippet_trains_and_evaluates(snippets, tiny_model_dir, prompts_file, serving):
    import my_rollout

    from slime.rollout.data_source import RolloutDataSourceWithBuffer

    args = rollout_args(tiny_model_dir, prompts_file, serving, "--rm-type", "last_number")
    groups = my_rollout.generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert [[s.index for s in g] for g in groups] == [[0, 1], [2, 3]]
    for sample in (s for group in groups for s in group):
        assert sample.response_length > 0 and sample.loss_mask == [1] * sample.response_length
        assert sample.status in (Status.COMPLETED, Status.TRUNCATED) and sample.reward in (0.0, 1.0)
    data = my_rollout.generate_rollout(args, 0, None, evaluation=True)
    probes = data["probes"]
    assert len(probes["samples"]) == len(probes["rewards"]) == len(probes["truncated"]) == len(my_rollout.PROBES)
    assert all(s.reward == r for s, r in zip(probes["samples"], probes["rewards"]))


async def run_stop(proxy_coroutine) -> None:
    await (await proxy_coroutine).stop()


@pytest.mark.slow
def test_agent_snippet_through_the_trajectory_proxy(snippets, tiny_model_dir, prompts_file, serving):
    from my_agent import answer_reward

    from slime.rollout import agent_rollout
    from slime.utils.async_utils import run

    args = rollout_args(tiny_model_dir, prompts_file, serving, "--agent-function-path", "my_agent.agent")
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 32}
    sample = run(agent_rollout.generate(args, Sample(index=0, prompt="What is 2 + 2?", label="4"), params))
    run(run_stop(agent_rollout.get_proxy(args)))
    assert sample.status in (Status.COMPLETED, Status.TRUNCATED), sample.metadata
    assert isinstance(sample.metadata["agent_answer"], str)
    assert len(sample.loss_mask) == sample.response_length and sum(sample.loss_mask) > 0
    expected = float("4" in sample.metadata["agent_answer"])
    assert asyncio.run(answer_reward(args, sample)) == expected
