"""The real chat in a real terminal (tmux) on SmolLM2-135M without a drafter: a block pasted with bracketed paste is one
turn with one answer; /regen, /save and /load; Ctrl-C during a generation; Ctrl-D."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a real model in a real terminal

REPO = Path(__file__).resolve().parent.parent
PROMPT = "you ›"
SNIPPET = "Fix this function:\ndef add(a, b):\n    return a - b"


class Tmux:
    """One tmux server of its own (its socket in `folder`) running one command in a pane of a fixed size."""

    def __init__(self, folder: Path, command: list[str], env: dict[str, str]):
        self.socket = str(folder / "tmux.sock")
        # the shell waits through Ctrl-C (a trap, not an ignore, which the chat would inherit) to say how it exited
        shell = "trap true INT; " + " ".join(shlex.quote(word) for word in command) + "; echo EXITED=$?; sleep 600"
        self.tmux("-f", "/dev/null", "new-session", "-d", "-s", "chat", "-x", "160", "-y", "50",
                  "-c", str(REPO), "env", *[f"{k}={v}" for k, v in env.items()], "sh", "-c", shell)
        self.tmux("set-option", "-t", "chat", "history-limit", "20000")
        self.seen = 0  # characters of the screen's text already matched

    def tmux(self, *args: str, text: str | None = None) -> str:
        return subprocess.run(["tmux", "-S", self.socket, *args], check=True, capture_output=True, text=True,
                              input=text).stdout

    def screen(self) -> str:
        """The pane's whole text, its history included, wrapped lines joined."""
        return self.tmux("capture-pane", "-p", "-J", "-S", "-", "-t", "chat")

    def expect(self, pattern: str, timeout: float = 600) -> str:
        """Wait (polling with a deadline) for `pattern` after what was matched before; the text up to its end."""
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        while True:
            text = self.screen()
            match = regex.search(text, self.seen)
            if match:
                seen, self.seen = text[self.seen:match.end()], match.end()
                return seen
            if time.monotonic() > deadline:
                raise AssertionError(f"no {pattern!r} in:\n{text[self.seen:][-3000:]}")
            time.sleep(0.2)

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "chat", *keys)

    def line(self, text: str) -> None:
        self.tmux("send-keys", "-t", "chat", "-l", text)
        self.keys("Enter")

    def paste(self, text: str) -> None:
        """`text` pasted as a terminal pastes it: bracketed, where the program asked for that (-p)."""
        self.tmux("load-buffer", "-b", "snippet", "-", text=text)
        self.tmux("paste-buffer", "-p", "-d", "-b", "snippet", "-t", "chat")

    def kill(self) -> None:
        subprocess.run(["tmux", "-S", self.socket, "kill-server"], capture_output=True)


@pytest.fixture(scope="module")
def chat(tmp_path_factory, model_cache_dir):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (.ci/run installs it)")
    folder = tmp_path_factory.mktemp("chat_tmux")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(folder), "TERM": "tmux-256color",
           "LANG": "C.UTF-8", "XDG_CACHE_HOME": str(folder / "xdg"), "COLUMNS": "160", "LINES": "50"}
    command = [sys.executable, "infer.py", "--target", "smollm2-135m", "--drafter", "none", "--no-calibrate",
               "--no-compile", "-n", "12", "--cache-dir", str(model_cache_dir)]
    terminal = Tmux(folder, command, env)
    terminal.folder = folder
    yield terminal
    terminal.kill()


def test_a_pasted_block_is_one_turn_then_regen_save_load_ctrl_c_ctrl_d(chat):
    chat.expect(PROMPT, timeout=900)  # a first run converts the model and probes this machine
    chat.paste(SNIPPET)
    chat.expect(re.escape("    return a - b"), timeout=30)  # the editor shows the whole block, unsent
    chat.keys("Enter")
    turn = chat.expect(PROMPT)
    assert turn.count("prompt:") == 1 and turn.count("tok/s") == 1, turn  # one message, one answer
    chat.line("/history")
    history = chat.expect(PROMPT)
    assert history.count("user ") == 1 and "user Fix this function:\ndef add(a, b):\n    return a - b" in history

    chat.line("/regen")
    regen = chat.expect(PROMPT)
    assert regen.count("tok/s") == 1
    prompt_tokens, cached = map(int, re.search(r"prompt: (\d+) tokens, (\d+) of them already", regen).groups())
    assert cached >= prompt_tokens - 1  # the cache was cropped back to the prompt, not filled again
    saved = chat.folder / "chat.json"
    chat.line(f"/save {saved}")
    chat.expect("saved 2 turns")
    chat.line("/reset")
    chat.expect("history cleared")
    chat.line(f"/load {saved}")
    chat.expect(r"resumed [^\n]*1 exchange in the\s+history")
    assert json.loads(saved.read_text())["history"][0]["content"] == SNIPPET

    chat.line("/length 2000")
    chat.expect(PROMPT)
    chat.line("Write a long story about a dragon.")
    chat.expect(r"autoregressive\n.{8}")  # the answer is streaming
    chat.keys("C-c")
    chat.expect("interrupted")
    chat.expect(PROMPT)
    chat.keys("C-d")
    chat.expect("EXITED=0")
