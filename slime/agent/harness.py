"""Drive an installed coding-agent CLI (Claude Code, Codex) in a sandbox against slime's agent server (upstream's
`slime.agent.harness`).

The CLI's base URL points at the server (an `AnthropicAdapter` / `OpenAIAdapter` app, or a `TrajectoryProxy`) and
its API key is the session id, so every request it makes is a turn of that session:

    async with LocalSandbox(SandboxLimits(allow_network=True, memory_mb=8192)) as sb:
        await sb.write_file("task.md", problem)
        exit_code = await CLAUDE_CODE.run(sb, workdir=sb.workdir, session_id=sid, adapter_url=handle.url,
                                          time_budget_sec=1800, prompt="Solve task.md.")

The CLI must already be installed where the sandbox runs it (`run` checks, and refuses naming the install command);
its settings and state go to `{workdir}/.harness/home` (its HOME), its output to `{workdir}/.harness/output.log`.
A `LocalSandbox` needs `allow_network` to reach the server and room for Node.js (several GB of address space).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from slime.agent.sandbox import EXIT_TIME_BUDGET_EXCEEDED, LocalSandbox, Sandbox, exec_and_wait

__all__ = [
    "BaseHarness",
    "CLAUDE_CODE",
    "CODEX",
    "ClaudeCodeHarness",
    "CodexHarness",
    "EXIT_TIME_BUDGET_EXCEEDED",
    "HarnessContext",
]


@dataclass(frozen=True)
class HarnessContext:
    """One agent run: the sandbox directory it works in, its session id (sent as the API key), the agent server's
    base URL, and the model name the CLI is told to ask for (the server answers with the served model whatever it
    is)."""

    workdir: str
    session_id: str
    adapter_url: str
    model_label: str = "slime-actor"

    @property
    def home(self) -> str:
        """The CLI's HOME: its settings and state, kept apart from the work."""
        return f"{self.workdir}/.harness/home"


class BaseHarness:
    """A coding-agent CLI run once per prompt: `command` and `env` build the call, `config_files` its settings.

    Args:
        extra_args: Appended to the CLI's command line.
        extra_env: Added to (and overriding) the CLI's environment.
    """

    name = ""
    binary = ""
    install_hint = ""

    def __init__(self, extra_args: tuple[str, ...] = (), extra_env: dict[str, str] | None = None):
        self.extra_args, self.extra_env = tuple(extra_args), dict(extra_env or {})

    def command(self, ctx: HarnessContext, prompt: str) -> list[str]:
        """The CLI's argv for one non-interactive run on `prompt`."""
        raise NotImplementedError

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        """The environment that points the CLI at `ctx.adapter_url` with the session id as its key."""
        raise NotImplementedError

    def config_files(self, ctx: HarnessContext) -> dict[str, str]:
        """Files to write before the run (sandbox path -> content)."""
        return {}

    async def check_cli(self, sb: Sandbox) -> None:
        """Raise RuntimeError naming the binary and how to install it when the sandbox cannot find the CLI."""
        code, found, _ = await sb.exec(f"command -v {shlex.quote(self.binary)}", timeout=30)
        if code != 0 or not found.strip():
            raise RuntimeError(
                f"the {self.name} harness needs the `{self.binary}` CLI, and it is not on the PATH where the sandbox "
                f"{sb.sandbox_id or '(unnamed)'} runs commands; install it there with `{self.install_hint}`"
            )

    async def write_config(self, sb: Sandbox, ctx: HarnessContext) -> None:
        """Write `config_files` into the sandbox."""
        for path, content in self.config_files(ctx).items():
            await sb.write_file(path, content)

    async def launch_and_wait(self, sb: Sandbox, ctx: HarnessContext, prompt: str, time_budget_sec: float) -> int:
        """Run the CLI on `prompt` to completion; returns its exit code (`EXIT_TIME_BUDGET_EXCEEDED` past the
        budget). Its output is saved to `{workdir}/.harness/output.log`."""
        env = {**self.env(ctx), **self.extra_env}
        cmd = shlex.join([*self.command(ctx, prompt), *self.extra_args])
        code, output = await exec_and_wait(
            sb, cmd=cmd, env=env, workdir=ctx.workdir, time_budget_sec=time_budget_sec, tag=self.name, want_output=True
        )
        await sb.write_file(f"{ctx.workdir}/.harness/output.log", output)
        return code

    async def run(
        self, sb: Sandbox, *, workdir: str, session_id: str, adapter_url: str, time_budget_sec: float, prompt: str
    ) -> int:
        """Check the CLI, write its settings, run it on `prompt` in `workdir`; returns its exit code.

        Raises:
            RuntimeError: The CLI is not installed in the sandbox.
            ValueError: `sb` is a `LocalSandbox` without network (the CLI could not reach `adapter_url`).
        """
        if isinstance(sb, LocalSandbox) and not sb.limits.allow_network:
            raise ValueError(
                f"the {self.name} CLI must reach {adapter_url}, and this LocalSandbox has no network; open it with "
                "LocalSandbox(SandboxLimits(allow_network=True, ...))"
            )
        await self.check_cli(sb)
        ctx = HarnessContext(workdir=workdir, session_id=session_id, adapter_url=adapter_url.rstrip("/"))
        await self.write_config(sb, ctx)
        return await self.launch_and_wait(sb, ctx, prompt, time_budget_sec)


class ClaudeCodeHarness(BaseHarness):
    """Claude Code (`claude -p`), headless with permissions bypassed, against an Anthropic Messages server
    (`AnthropicAdapter`): ANTHROPIC_BASE_URL is the server, ANTHROPIC_AUTH_TOKEN (a bearer token) the session id."""

    name = "claude_code"
    binary = "claude"
    install_hint = "npm install -g @anthropic-ai/claude-code"
    # No update checks, telemetry or experimental request fields: every request goes to the server and is plain.
    static_env = {
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CODE_DISABLE_EXPERIMENTAL_BETAS": "1",
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
    }

    def command(self, ctx: HarnessContext, prompt: str) -> list[str]:
        return [self.binary, "-p", prompt, "--permission-mode", "bypassPermissions", "--output-format", "stream-json",
                "--verbose"]  # fmt: skip

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        return {
            "HOME": ctx.home,
            "ANTHROPIC_BASE_URL": ctx.adapter_url,
            "ANTHROPIC_AUTH_TOKEN": ctx.session_id,
            "ANTHROPIC_MODEL": ctx.model_label,
            **self.static_env,
        }

    def config_files(self, ctx: HarnessContext) -> dict[str, str]:
        # Onboarding done and bypass mode accepted ahead: otherwise the CLI stops to ask.
        settings = json.dumps({"hasCompletedOnboarding": True, "bypassPermissionsModeAccepted": True})
        return {f"{ctx.home}/.claude.json": settings, f"{ctx.home}/.claude/settings.json": settings}


class CodexHarness(BaseHarness):
    """Codex (`codex exec`) against an OpenAI chat-completions server (`OpenAIAdapter`), through a `slime` model
    provider in its config.toml (Codex reads a custom provider's base URL only from there); its key, the session id,
    is OPENAI_API_KEY. Codex's own sandbox is bypassed: the outer sandbox confines it."""

    name = "codex"
    binary = "codex"
    install_hint = "npm install -g @openai/codex"

    def command(self, ctx: HarnessContext, prompt: str) -> list[str]:
        return [self.binary, "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", "--json",
                prompt]  # fmt: skip

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        return {"HOME": ctx.home, "OPENAI_API_KEY": ctx.session_id, "OPENAI_BASE_URL": f"{ctx.adapter_url}/v1"}

    def config_files(self, ctx: HarnessContext) -> dict[str, str]:
        config = (
            f"model = {json.dumps(ctx.model_label)}\n"
            'model_provider = "slime"\n'
            "\n[model_providers.slime]\n"
            'name = "slime"\n'
            f"base_url = {json.dumps(ctx.adapter_url + '/v1')}\n"
            'env_key = "OPENAI_API_KEY"\n'
            'wire_api = "chat"\n'  # the adapter serves chat completions
        )
        return {f"{ctx.home}/.codex/config.toml": config}


CLAUDE_CODE = ClaudeCodeHarness()
CODEX = CodexHarness()
