"""The real coding agents, end to end: each runs headless against `mlxd serve`,
calls its own shell tool on the first turn and answers after the tool result.

The clients are the npm packages `make agents` installs (tests/agents/ pins
their versions). The model is scripted (tests/scripted_model.py): greedy
decoding calls the client's shell tool with a command that creates a file in
the client's working directory, then, once the conversation holds the tool's
result, says ANSWER. So a passing run shows the whole loop through each
client's own dialect: its requests accepted, the tool call parsed and streamed
back in the shape the client executes, the tool result sent back and served.
Each client gets a fresh HOME, so no configuration of the machine leaks in.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import running
from tests.scripted_model import make_scripted_model

BIN = Path(__file__).parent / "agents" / "node_modules" / ".bin"
KEY = "agent-test-key"
ANSWER = "The command ran."
SIDE_EFFECT = "agent_was_here"
PROMPT = f"Run the shell command: touch {SIDE_EFFECT}"
# The agents' system prompts and tool lists run to 38,000 tokens of the test tokenizer.
CONTEXT = 65536


@dataclass(frozen=True)
class Agent:
    name: str
    tool: str  # the client's own shell tool
    arguments: dict
    endpoint: str  # what the client speaks

    def configure(self, home: Path, work: Path, base_url: str,
                  idle_timeout_ms: int | None = None) -> tuple[list[str], dict]:
        """Write the client's configuration; return its command line and environment.
        idle_timeout_ms: how long Codex or OpenCode waits for the next event of a
        stream before it gives up on it (Codex then fails: no retry here)."""
        env = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8"}
        if self.name == "claude-code":
            env |= {"ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_AUTH_TOKEN": KEY,
                    "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
            # --allowedTools rather than skipping permissions, which Claude Code refuses to do as root.
            return [str(BIN / "claude"), "-p", PROMPT, "--allowedTools", "Bash", "--max-turns", "3"], env
        if self.name == "codex":
            (home / ".codex").mkdir()
            (home / ".codex" / "config.toml").write_text(
                'model = "gpt-5-codex"\nmodel_provider = "mlxd"\n\n[model_providers.mlxd]\nname = "mlxd"\n'
                f'base_url = "{base_url}/v1"\nenv_key = "MLXD_KEY"\nwire_api = "responses"\n'
                + (f"stream_idle_timeout_ms = {idle_timeout_ms}\nstream_max_retries = 0\n" if idle_timeout_ms else ""))
            env |= {"MLXD_KEY": KEY}
            return [str(BIN / "codex"), "exec", "--skip-git-repo-check",
                    "--dangerously-bypass-approvals-and-sandbox", PROMPT], env
        options = {"baseURL": f"{base_url}/v1", "apiKey": KEY} | ({"chunkTimeout": idle_timeout_ms} if idle_timeout_ms else {})
        (work / "opencode.json").write_text(json.dumps({"provider": {"mlxd": {
            "npm": "@ai-sdk/openai-compatible", "models": {"scripted": {}}, "options": options}}}))
        return [str(BIN / "opencode"), "run", "-m", "mlxd/scripted", PROMPT], env


AGENTS = [
    Agent("claude-code", "Bash", {"command": f"touch {SIDE_EFFECT}"}, "/v1/messages"),
    Agent("codex", "exec_command", {"cmd": f"touch {SIDE_EFFECT}"}, "/v1/responses"),
    Agent("opencode", "bash", {"command": f"touch {SIDE_EFFECT}", "description": "Create a file"},
          "/v1/chat/completions"),
]


def run_agent(agent: Agent, tmp_path: Path, serve_args: tuple[str, ...] = (), idle_timeout_ms: int | None = None,
              project_notes: str = "") -> tuple[subprocess.CompletedProcess, str, Path]:
    """The agent run once on PROMPT against `mlxd serve` (with serve_args); its
    run, the server's /metrics after it, and its working directory.
    idle_timeout_ms: see Agent.configure; project_notes: an AGENTS.md."""
    assert (BIN / "claude").exists(), "the coding agents are not installed: run `make agents`"
    call = json.dumps({"name": agent.tool, "arguments": agent.arguments})
    model = make_scripted_model(tmp_path / "model", ["<tool_call>", call, "</tool_call>"],
                                after_tool=[ANSWER], context=CONTEXT)
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    if project_notes:
        (work / "AGENTS.md").write_text(project_notes)
    # Clients send their own model names (claude-…, gpt-…): the alias serves them.
    args = ["serve", "--model", str(model), "--served-model-name", "scripted", "--model-alias", "*=scripted",
            "--api-key", KEY, *serve_args]
    with running(args, tmp_path / "serve.log") as server:
        command, env = agent.configure(home, work, server.url, idle_timeout_ms)
        run = subprocess.run(command, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                             text=True, timeout=240)
        served = server.http.get("/metrics", headers={"authorization": f"Bearer {KEY}"}).text
    return run, served, work


def requests_answered(served: str, endpoint: str) -> int:
    answered = f'mlxd_requests_total{{endpoint="{endpoint}",status="200"}} '
    return sum(int(line.split()[-1]) for line in served.splitlines() if line.startswith(answered))


@pytest.mark.parametrize("agent", AGENTS, ids=[a.name for a in AGENTS])
def test_the_agent_runs_its_shell_tool_and_answers(agent, tmp_path):
    run, served, work = run_agent(agent, tmp_path)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    assert (work / SIDE_EFFECT).exists(), f"the tool call did not run:\n{output[-3000:]}"
    assert ANSWER in run.stdout, f"no answer after the tool result:\n{output[-3000:]}"
    # Both turns went through the client's own dialect.
    assert requests_answered(served, agent.endpoint) >= 2, served


@pytest.mark.parametrize("agent, requests", [(AGENTS[1], 2), (AGENTS[2], 3)], ids=["codex", "opencode"])
def test_the_agent_waits_through_a_long_prefill(agent, requests, tmp_path):
    """Codex and OpenCode give up on a stream with no event for a while (5
    minutes unless set; a long context's prefill on a Mac can take longer) and
    send the request again. Here they wait 3 seconds, and project notes add
    27,000 tokens to the agent's own instructions and tools: the first turn's
    prefill takes longer than that on this CPU (4.7 s for Codex, 6 s for
    OpenCode; both fail with keep-alives off). mlxd's keep-alives carry it
    through, and no request is sent twice (OpenCode's third is its title for
    the session). The wait is that long because a client's own event loop
    stalls while the prefill takes the CPU: waiting half a second here, or one
    second under CI's load, OpenCode gave up on streams with an event every
    0.2 s."""
    notes = ("Keep every answer short and plain. " * 1500)[: 40 << 10]
    run, served, work = run_agent(agent, tmp_path, serve_args=("--stream-keepalive-s", "0.2"), idle_timeout_ms=3000,
                                  project_notes=notes)
    output = run.stdout + run.stderr
    assert run.returncode == 0 and ANSWER in run.stdout, output[-3000:]
    assert (work / SIDE_EFFECT).exists()
    assert requests_answered(served, agent.endpoint) == requests, served
