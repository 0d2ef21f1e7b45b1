"""The chat's input layer without a terminal: prompt_toolkit's own pipe input and dummy output drive the line editor
(pastes, Alt+Enter, \"\"\" blocks, Tab completion, history), and plain lines drive the piped reader."""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path

import pytest
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from chat.commands import build_commands
from chat.completion import CommandCompleter
from chat.editor import HISTORY_ENTRIES, KeptHistory, PipedReader, TerminalReader, as_text, block_open, unblock

PASTE_START, PASTE_END = "\x1b[200~", "\x1b[201~"
ALT_ENTER = "\x1b\r"


def paste(text: str) -> str:
    """What a terminal sends for a paste in bracketed-paste mode (lines end in \\r, as terminals paste them)."""
    return PASTE_START + text.replace("\n", "\r") + PASTE_END


def read_keys(keys: str, history_file: Path | None = None, reads: int = 1) -> list[str]:
    """The messages the editor hands back for `keys`."""
    with create_pipe_input() as pipe:
        reader = TerminalReader(CommandCompleter(build_commands), history_file, color=False, input=pipe,
                                output=DummyOutput())
        pipe.send_text(keys)
        return [reader.read("you ›") for _ in range(reads)]


def test_a_pasted_block_is_one_message():
    snippet = "Fix this function:\ndef add(a, b):\n    return a - b"
    assert read_keys(paste(snippet) + "\r") == [snippet]


def test_a_paste_of_200_lines_is_one_message():
    block = "\n".join(f"line {i}: x = {i} * 2" for i in range(200))
    [message] = read_keys(paste(block) + "\r")
    assert message == block and message.count("\n") == 199


def test_a_paste_with_slashes_at_line_starts_is_text_not_a_command():
    inner = "Why does this fail?\n/usr/bin/env: python: No such file\n/help is not a command here"
    assert read_keys(paste(inner) + "\r") == [inner]
    starting = "/usr/bin/env: python: No such file\nwhat now?"
    [message] = read_keys(paste(starting) + "\r")
    assert message == "/" + starting  # escaped: the REPL sends it as text (// is its escape)


def test_a_paste_deleted_before_a_command_is_typed_leaves_the_command_a_command():
    assert read_keys(paste("/tmp/x\nmore") + "\x7f" * 11 + "/help\r") == ["/help"]


def test_a_one_line_paste_of_a_command_stays_a_command():
    assert read_keys(paste("/help") + "\r") == ["/help"]


def test_enter_sends_and_alt_enter_adds_a_line():
    assert read_keys("first" + ALT_ENTER + "second\r") == ["first\nsecond"]
    assert read_keys("one\rtwo\r", reads=2) == ["one", "two"]


def test_a_block_in_triple_quotes_goes_on_over_enter():
    keys = '"""\rFix this:\r/etc/passwd is odd\r"""\r'
    assert read_keys(keys) == ["Fix this:\n/etc/passwd is odd"]
    assert read_keys('"""/start"""\r') == ["//start"]


def test_a_trailing_backslash_goes_on_on_the_next_line():
    assert read_keys("Be\\\rbrief.\r") == ["Be\nbrief."]


def test_ctrl_c_and_ctrl_d_at_the_prompt():
    with pytest.raises(KeyboardInterrupt):
        read_keys("half a line\x03")
    with pytest.raises(EOFError):
        read_keys("\x04")


def test_invalid_utf8_reaches_the_repl_as_surrogates():
    with create_pipe_input() as pipe:
        reader = TerminalReader(color=False, input=pipe, output=DummyOutput())
        pipe.send_bytes(b"caf\xe9 ok\r")
        assert reader.read("you ›") == "caf\udce9 ok"  # the REPL replaces it and says so (chat.undecodable)


def test_history_is_kept_across_sessions_and_recalled_with_up(tmp_path):
    history = tmp_path / "history"
    read_keys("/gamma 3\r" + "two\nlines".replace("\n", ALT_ENTER) + "\r", history, reads=2)
    assert read_keys("\x1b[A\r", history) == ["two\nlines"]
    # Up inside a recalled message of several lines moves up its lines first, then to the message before
    assert read_keys("\x1b[A\x1b[A\x1b[A\x1b[A\r", history) == ["/gamma 3"]
    assert read_keys("\x1b[A\r", history) == ["/gamma 3"]  # the recalled one was stored again, newest


def test_history_reads_the_file_readline_wrote_and_keeps_the_newest(tmp_path):
    history = tmp_path / "history"
    history.write_text("".join(f"old {i}\n" for i in range(HISTORY_ENTRIES + 5)))
    entries = list(KeptHistory(history).load_history_strings())
    assert len(entries) == HISTORY_ENTRIES and entries[0] == f"old {HISTORY_ENTRIES + 4}"
    assert history.read_text().startswith("\n+old 5\n")  # rewritten in the editor's own format
    assert list(KeptHistory(history).load_history_strings()) == entries


def complete(text: str) -> list[str]:
    from prompt_toolkit.completion import CompleteEvent
    from prompt_toolkit.document import Document

    completer = CommandCompleter(build_commands)
    return [c.text for c in completer.get_completions(Document(text), CompleteEvent(completion_requested=True))]


def test_tab_completes_commands_strategies_words_and_paths(tmp_path, monkeypatch):
    assert complete("/re") == ["/reset", "/regen", "/read"] or set(complete("/re")) == {"/reset", "/regen", "/read"}
    assert complete("/strategies speculative,auto") == ["autoregressive", "auto"]
    assert complete("/compare o") == ["on", "off"]
    assert complete("/help ga") == ["gamma"]
    assert "greedy" in complete("/processor gr")
    (tmp_path / "notes.txt").write_text("x")
    monkeypatch.chdir(tmp_path)
    assert complete("/read no") == ["tes.txt"]
    assert complete("/export llama") == ["llamacpp"]
    assert complete("hello /re") == [] and complete("//re") == []


def test_tab_in_the_editor_completes_a_command():
    """Completions arrive in the background: Enter is sent once the buffer holds the completed name."""
    with create_pipe_input() as pipe:
        reader = TerminalReader(CommandCompleter(build_commands), color=False, input=pipe, output=DummyOutput())
        result: list[str] = []
        thread = threading.Thread(target=lambda: result.append(reader.read("you ›")))
        thread.start()
        pipe.send_text("/rege\t")
        deadline = time.monotonic() + 30
        while reader.prompt_session.default_buffer.text != "/regen" and time.monotonic() < deadline:
            time.sleep(0.01)
        pipe.send_text("\r")
        thread.join(30)
    assert result == ["/regen"]


def test_block_helpers():
    assert block_open('"""') and block_open('"""\nabc') and not block_open('"""\nabc\n"""')
    assert not block_open('"""x"""') and not block_open("plain")
    assert unblock('"""\nabc\n"""') == "abc" and unblock("plain") == "plain"
    assert as_text("/x") == "//x" and as_text("x") == "x"


def test_piped_lines_are_messages_with_blocks_and_continuations(monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO('hello\n"""\nFix:\n  x = 1\n"""\nBe\\\nbrief.\n/help\n"""\nunended'))
    reader = PipedReader()
    messages = [reader.read("you ›") for _ in range(5)]
    assert messages == ["hello", "Fix:\n  x = 1", "Be\nbrief.", "/help", "unended"]
    with pytest.raises(EOFError):
        reader.read("you ›")
