"""``ggraph chat`` in a real terminal (a pty): prompts, streaming replies, commands, a context that fills,
Ctrl-C and Ctrl-D; and ``ggraph run -n -1``."""
import fcntl
import os
import pty
import select
import signal
import subprocess
import sys
import termios
import time

import pytest

import zoo
from ggraph.cli import main

TIMEOUT = 120


class Terminal:
    """A process on the slave side of a pty, as a terminal user runs it: type text, wait for output."""

    def __init__(self, args):
        master, slave = pty.openpty()
        self.master, self.out = master, b""

        def controlling_tty():                       # so that Ctrl-C typed here is SIGINT there
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
            # as a terminal's shell starts it: a test run started in the background (`pytest &` in a
            # script) ignores SIGINT, the child would inherit that, and Python would then never
            # raise KeyboardInterrupt for the Ctrl-C typed here
            signal.signal(signal.SIGINT, signal.SIG_DFL)

        self.proc = subprocess.Popen([sys.executable, "-m", "ggraph.cli", *map(str, args)], stdin=slave,
                                     stdout=slave, stderr=slave, start_new_session=True,
                                     preexec_fn=controlling_tty, env={**os.environ, "COLUMNS": "100"})
        os.close(slave)

    def _read(self, seconds: float) -> bool:
        ready, _, _ = select.select([self.master], [], [], seconds)
        if not ready:
            return False
        try:
            self.out += os.read(self.master, 65536)
        except OSError:                              # the process has gone and closed its side
            return False
        return True

    def expect(self, text: str, start: int = 0) -> int:
        """Wait until ``text`` appears after offset ``start``; the offset just past it."""
        deadline = time.monotonic() + TIMEOUT
        while (at := self.out.find(text.encode(), start)) < 0:
            if time.monotonic() > deadline or (not self._read(0.5) and self.proc.poll() is not None):
                raise AssertionError(f"{text!r} never came; the terminal shows:\n{self.text[-3000:]}")
        return at + len(text)

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def wait(self) -> int:
        deadline = time.monotonic() + TIMEOUT
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._read(0.2)
        while self._read(0.1):
            pass
        return self.proc.wait(timeout=5)

    @property
    def text(self) -> str:
        return self.out.decode(errors="replace").replace("\r\n", "\n")

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        os.close(self.master)


@pytest.fixture
def terminal():
    opened = []

    def start(*args):
        opened.append(Terminal(args))
        return opened[-1]
    yield start
    for t in opened:
        t.close()


@pytest.fixture(scope="module")
def model():
    return zoo.cached_model("qwen2", "f32")


def test_a_conversation_with_commands_and_a_context_that_fills(terminal, model):
    t = terminal("chat", model, "--backend", "numpy", "--ctx", "120", "-n", "10", "--temp", "0", "--stats",
                 "--system", "Be brief.")
    at = t.expect("/help lists the commands.")
    at = t.expect("> ", at)
    t.type("Hello there\r")
    at = t.expect("[prefilled ", at)
    at = t.expect("> ", at)
    t.type("/help\r")
    at = t.expect("/reset         forget the conversation", at)
    t.type("/nonsense\r")
    at = t.expect("unknown command /nonsense", at)
    t.type("a question \\\r")                       # continued on the next line
    at = t.expect(". ", at)
    t.type("over two lines\r")
    at = t.expect("reused from the cache", at)
    for i in range(4):                              # 120 tokens hold two or three exchanges
        t.type(f"message {i} with a few words\r")
        at = t.expect("reused from the cache", at)
    assert "the context is full: dropped the" in t.text
    t.type("/system\r")
    at = t.expect("system message removed", at)
    t.type("/reset\r")
    at = t.expect("the conversation is forgotten", at)
    t.type("again\r")
    at = t.expect("(0 reused from the cache)", at)
    t.type("/exit\r")
    assert t.wait() == 0
    assert "Traceback" not in t.text


def test_ctrl_c_stops_a_reply_and_ctrl_d_leaves(terminal, model):
    # a random model talks until -n stops it: 4000 tokens take the numpy backend many seconds even on a
    # fast machine, so the reply cannot end before the Ctrl-C lands (300 once did, in 1.6 s)
    t = terminal("chat", model, "--backend", "numpy", "--ctx", "4096", "-n", "4000", "--temp", "0", "--stats")
    at = t.expect("> ", t.expect("/help lists the commands."))
    t.type("Tell me everything.\r")
    at = t.expect("Tell me everything.", at)
    for message in ("one more", None):              # stop two replies, then leave from the prompt
        while len(t.out) < at + 40:                 # some of the reply has streamed
            assert t._read(TIMEOUT), t.text
        t.type("\x03")
        at = t.expect("> ", t.expect("note: reply stopped", at))
        if message:
            t.type(message + "\r")
            at = t.expect(message, at)
    time.sleep(0.5)     # a person reads the prompt first: CPython's readline misses a SIGINT that lands between
    t.type("\x03")      # printing the prompt and waiting for keys, until the next key. Ctrl-C at the prompt leaves
    assert t.wait() == 0 and "Traceback" not in t.text


def test_ctrl_d_at_the_prompt_leaves(terminal, model):
    t = terminal("chat", model, "--backend", "numpy", "--ctx", "64", "-n", "4", "--temp", "0")
    t.expect("> ", t.expect("/help lists the commands."))
    t.type("\x04")
    assert t.wait() == 0


def test_piped_input_is_a_transcript(model):
    done = subprocess.run([sys.executable, "-m", "ggraph.cli", "chat", str(model), "--backend", "numpy", "--ctx",
                           "128", "-n", "5", "--temp", "0"], input="hi\n/reset\nhello\n", capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n") == 2 and "> " not in done.stdout     # two replies, no prompts
    assert "the conversation is forgotten" in done.stderr


def test_bad_arguments_are_one_line(model, capsys):
    assert main(["chat", str(model), "-n", "-2"]) == 1
    assert "--n-predict must be >= -1" in capsys.readouterr().err
    assert main(["chat", str(model), "--temp", "-1"]) == 1
    assert "temperature" in capsys.readouterr().err


def test_run_until_the_end_of_text(model, capsys):
    assert main(["run", str(model), "-p", "Once upon a time", "-n", "-1", "--ctx", "40", "--temp", "0",
                 "--backend", "numpy"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("Once upon a time")
    assert "generated: " in captured.err
    if "eog" not in captured.err:                   # a random model rarely ends its text
        assert "note: the context is full (--ctx 40): generation stopped" in captured.err
    assert main(["run", str(model), "-p", "x", "-n", "-3"]) == 1
    assert "--n-predict must be >= -1 (-1: until the end of text), got -3" in capsys.readouterr().err
