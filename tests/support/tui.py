"""Helpers for the full-screen UI tests (no tests here): a tmux session driven with send-keys
and read with capture-pane, and readers of the table on its screen."""

import os
import re
import shutil
import subprocess
import time

import pytest

from support.machine import slowness


class Tmux:
    def __init__(self, tmp_path, width=170, height=40):
        if shutil.which("tmux") is None:
            pytest.skip("tmux is not installed")
        self.sock = f"pymtrace-test-{os.getpid()}-{id(self)}"
        self.tmp = tmp_path
        self.run(
            "new-session",
            "-d",
            "-s",
            "t",
            "-x",
            str(width),
            "-y",
            str(height),
            "env -i PATH=/usr/bin:/bin TERM=screen HOME=/tmp PS1='READY$ ' bash --norc --noprofile",
        )
        self.wait_for(lambda s: "READY$" in s, "shell prompt")

    def run(self, *args):
        return subprocess.run(["tmux", "-L", self.sock, *args], check=True, capture_output=True, text=True).stdout

    def send(self, *keys):
        self.run("send-keys", "-t", "t", *keys)

    def type(self, line):
        self.run("send-keys", "-t", "t", "-l", line)
        self.send("Enter")

    def screen(self):
        return self.run("capture-pane", "-p", "-t", "t")

    def alternate_on(self):
        return self.run("display-message", "-p", "-t", "t", "#{alternate_on}").strip() == "1"

    def wait_for(self, pred, what, timeout=20, fail_on=None):
        """The screen once PRED holds, within TIMEOUT seconds on a real machine (times
        slowness() where the CPU is emulated: `top --stacks` took ~80 s to its first screen
        in a Debian VM running its suite, where the bound was 120 s)."""
        deadline = time.monotonic() + timeout * slowness()
        s = ""
        while time.monotonic() < deadline:
            s = self.screen()
            if pred(s):
                return s
            if fail_on and fail_on in s:
                raise AssertionError(f"{fail_on!r} while waiting for {what}; screen:\n{s}")
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; screen:\n{s}")

    def stty(self, name):
        path = self.tmp / name
        self.type(f"stty -g > {path}; echo STTY-{name}-DONE")
        self.wait_for(lambda s: f"STTY-{name}-DONE" in s.replace(f"echo STTY-{name}-DONE", ""), "stty")
        return path.read_text().strip()

    def kill(self):
        subprocess.run(["tmux", "-L", self.sock, "kill-server"], capture_output=True)


def _header_index(lines, header_word):
    """The index of the table's header line (its first word HEADER_WORD, maybe with the sort
    mark v/^) among LINES."""
    for i, line in enumerate(lines):
        words = line.split()
        if words and words[0].rstrip("v^") == header_word:
            return i
    raise AssertionError(f"no header with {header_word!r} on screen:\n" + "\n".join(lines))


def rows(screen, header_word):
    """The table rows (lists of fields) under the header line that contains HEADER_WORD."""
    lines = screen.splitlines()
    out = []
    for row in lines[_header_index(lines, header_word) + 1 :]:
        if not row.strip() or re.match(r"\d-\d/Tab view", row.lstrip()):  # the key line
            break
        out.append(row.split())
    return out


def selected_row(t, header_word):
    """The fields of the row drawn highlighted (standout or reverse: the selection) under the
    header with HEADER_WORD, from the screen with its attributes (capture-pane -e); None
    when no row is."""
    raw = t.run("capture-pane", "-p", "-e", "-t", "t").splitlines()
    plain = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in raw]
    table = rows("\n".join(plain), header_word)
    for line, fields in zip(raw[_header_index(plain, header_word) + 1 :], table):
        lead = re.match(r"(?:\x1b\[[0-9;]*m)*", line).group(0)
        if re.search(r"\x1b\[(?:[0-9;]*;)?[37]m", lead):
            return fields
    return None


def comms(screen):
    return [r[1] for r in rows(screen, "PID") if r and r[0].isdigit()]


def wait_order(t, order, what):
    return t.wait_for(lambda s: "PID" in s and comms(s) == order, what)


def assert_clean_shell(t, before):
    t.wait_for(lambda s: not t.alternate_on(), "alternate screen off", timeout=10)
    t.type("echo BACK-AT-SHELL")
    s = t.wait_for(lambda s: re.search(r"^BACK-AT-SHELL$", s, re.M), "shell after exit")
    assert "READY$" in s
    assert t.stty("after") == before, "terminal modes not restored"
