"""The full-screen (curses) display of `pymtrace top`.

    run(source, interval, view) -> exit code

SOURCE is a callable returning the current snapshot (cumulative counters since attach, the
dict views.py documents). It should return at once; this module calls it every
INTERVAL seconds (default 1), computes the rates from the snapshot before (using the
snapshots' "time" fields) and draws the chosen view. SOURCE may return None (nothing new:
the last snapshot stays) or raise StopIteration (end: the UI exits with 0, e.g. when every
watched process is gone).

Keys: 1-6 view (Tab / Shift-Tab cycle), Left/Right or < > sort column, r reverse order,
p or space pause, Up/Down/PgUp/PgDn/Home scroll, q quit. In view 5 (call stacks) Up/Down
select a row and Enter shows (or hides) its full stacks, root to leaf; in view 6 (heap
efficiency) Up/Down select a process, whose sentence shows below. The selection follows its
call site or process when the rows re-sort (as in htop), not its position.

The terminal is restored on every way out: q, Ctrl-C, SIGTERM (turned into
KeyboardInterrupt) and exceptions (curses.wrapper restores the terminal before the
exception propagates).
"""

from __future__ import annotations

import curses
import os
import signal
import sys
import time
from types import FrameType
from typing import Callable, NoReturn, Optional, Sequence, Union

from pymtrace.errors import PymtraceError
from pymtrace.sinks import views
from pymtrace.sinks.text import printable
from pymtrace.sources.snapshot import Snapshot

HELP = "1-6/Tab view  </> sort  r reverse  p/space pause  Up/Down scroll  q quit"
HELP_STACKS = "1-6/Tab view  </> sort  r reverse  p pause  Up/Down select  Enter stacks  q quit"
STACKS_VIEW = views.VIEWS.index("stacks")
HEAP_VIEW = views.VIEWS.index("heap")
HELP_HEAP = "1-6/Tab view  </> sort  r reverse  p pause  Up/Down select (its line below)  q quit"

KEY_VIEW = {ord(str(i + 1)): i for i in range(len(views.VIEWS))}


class State:
    """Everything the screen shows, separate from curses so it can be tested directly."""

    def __init__(self, interval: float = 1.0, view: int = 0) -> None:
        self.interval = float(interval) if interval and interval > 0 else 1.0
        self.view = view
        self.sort = {}  # view index -> (column index, descending)
        self.paused = False
        self.prev = None
        self.cur = None
        self.scroll = 0
        self.quit = False
        self.selected = 0  # the stacks or heap view's selected row: its position on the screen
        self.selected_key = None  # ... and what it is (views.row_key), which select() follows
        self.detail = False  # the stacks view shows the selected row's stacks

    def push(self, snapshot: Optional[Snapshot]) -> None:
        if snapshot is None:
            return
        self.prev, self.cur = self.cur, snapshot

    def table(self) -> views.Table:
        sort, reverse = self.sort.get(self.view, (None, None))
        return views.build(self.view + 1, self.prev, self.cur or {}, interval=self.interval, sort=sort, reverse=reverse)

    def key(self, ch: int) -> bool:
        """Apply key CH (an int as from getch); returns True when the screen must be redrawn."""
        n = len(views.VIEWS)
        if ch in (ord("q"), ord("Q")):
            self.quit = True
        elif ch in KEY_VIEW:
            self._set_view(KEY_VIEW[ch])
        elif ch == ord("\t"):
            self._set_view((self.view + 1) % n)
        elif ch == curses.KEY_BTAB:
            self._set_view((self.view - 1) % n)
        elif ch in (curses.KEY_LEFT, ord("<"), ord(",")):
            self._move_sort(-1)
        elif ch in (curses.KEY_RIGHT, ord(">"), ord(".")):
            self._move_sort(+1)
        elif ch in (ord("r"), ord("R")):
            t = self.table()
            self.sort[self.view] = (t.sort, not t.reverse)
        elif ch in (ord("p"), ord("P"), ord(" ")):
            self.paused = not self.paused
        elif self.view == STACKS_VIEW and ch in (curses.KEY_ENTER, ord("\n"), ord("\r")):
            self.detail = not self.detail
            self.scroll = 0
        elif self.view in (STACKS_VIEW, HEAP_VIEW) and not self.detail and ch in (curses.KEY_DOWN, curses.KEY_UP):
            # a position on the screen drawn last, which select() turns into that row's key
            self.selected = max(0, self.selected + (1 if ch == curses.KEY_DOWN else -1))
            self.selected_key = None
        elif ch == curses.KEY_DOWN:
            self.scroll += 1
        elif ch == curses.KEY_UP:
            self.scroll = max(0, self.scroll - 1)
        elif ch == curses.KEY_NPAGE:
            self.scroll += 10
        elif ch == curses.KEY_PPAGE:
            self.scroll = max(0, self.scroll - 10)
        elif ch == curses.KEY_HOME:
            self.scroll = 0
        elif ch == curses.KEY_RESIZE:
            pass
        else:
            return False
        return True

    def select(self, table: views.Table) -> int:
        """The selected row's index in TABLE (-1: no rows): the row with the selected key when
        it is still there (the rows re-sort as rates change), else the one at the selected
        position; remembers both."""
        if not table.rows:
            return -1
        keys = [views.row_key(table, r) for r in table.rows]
        if self.selected_key in keys:
            self.selected = keys.index(self.selected_key)
        else:
            self.selected = min(self.selected, len(keys) - 1)
        self.selected_key = keys[self.selected]
        return self.selected

    def _set_view(self, i: int) -> None:
        if i != self.view:
            self.view = i
            self.scroll = 0
            self.detail = False
            self.selected, self.selected_key = 0, None

    def _move_sort(self, step: int) -> None:
        t = self.table()
        col = (t.sort + step) % len(t.columns)
        # numbers sort biggest first, names alphabetically, like top
        self.sort[self.view] = (col, t.columns[col].numeric)


def layout(table: views.Table, width: int) -> tuple[str, list[str]]:
    """(header line, row lines) with columns sized to their content, cut to WIDTH."""
    heads = views.headers(table)
    cells = views.format_rows(table)
    widths = [len(h) for h in heads]
    for row in cells:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))
    # a long name column (COMM, CACHE, REGION) must not push the numbers off screen
    for i, c in enumerate(table.columns):
        if not c.numeric:
            widths[i] = min(widths[i], 40)

    tail_cut = {i for i, c in enumerate(table.columns) if c.key == "region"}  # paths: keep the file name

    def line(values: Sequence[str]) -> str:
        parts = []
        for i, (v, w) in enumerate(zip(values, widths)):
            if len(v) > w:
                v = "~" + v[len(v) - w + 1 :] if i in tail_cut else v[: w - 1] + "~"
            parts.append(v.rjust(w) if table.columns[i].numeric else v.ljust(w))
        return " ".join(parts)[:width]

    return line(heads), [line(r) for r in cells]


def heap_notes(table: views.Table, selected: int) -> list[str]:
    """The heap view's note lines on the full screen: the SELECTED row's sentence (flagged or
    not), then the notes that are not another row's flag line."""
    details = [views.row_detail(table, r) for r in table.rows]
    own = details[selected] if 0 <= selected < len(details) else None
    return ([own] if own else []) + [n for n in table.notes if n not in details]


def draw(scr: curses.window, state: State, table: views.Table) -> None:
    scr.erase()
    height, width = scr.getmaxyx()
    if height < 5 or width < 20:
        _put(scr, 0, 0, "terminal too small", width)
        scr.refresh()
        return
    tabs = "  ".join(
        (f"[{i + 1} {views.TITLES[v]}]" if i == state.view else f"{i + 1} {views.TITLES[v]}")
        for i, v in enumerate(views.VIEWS)
    )
    sort_col = table.columns[table.sort].title
    status = f"every {state.interval:g}s  sort {sort_col} {'desc' if table.reverse else 'asc'}"
    if state.paused:
        status += "  PAUSED"
    _put(scr, 0, 0, f"pymtrace top  {tabs}  {status}", width, curses.A_BOLD)
    head, lines = layout(table, width)
    stacks = state.view == STACKS_VIEW
    selecting = state.view in (STACKS_VIEW, HEAP_VIEW)
    notes = list(table.notes)
    if selecting and lines:
        state.select(table)
        if stacks and state.detail:
            lines = views.detail_lines(table, table.rows[state.selected], most=10)
        if state.view == HEAP_VIEW:  # the selected process's line first, then the view's own notes
            notes = heap_notes(table, state.selected)
    if state.prev is None:  # the first interval after attach is running: no rates yet
        _put(scr, 1, 0, f"measuring the first {state.interval:g}s interval...", width)
        lines = []
    else:
        _put(scr, 1, 0, views.summary(table), width)
    _put(scr, 2, 0, head.ljust(width)[:width], width, curses.A_REVERSE)
    body_top, body_bottom = 3, height - 2  # last line: help
    room = body_bottom - body_top + 1
    note_lines = min(len(notes), max(0, room // 2)) if notes else 0
    room_rows = room - note_lines - (1 if note_lines and lines else 0)
    if selecting and not state.detail:  # keep the selected row on screen
        state.scroll = min(max(state.scroll, state.selected - room_rows + 1), state.selected)
    state.scroll = max(0, min(state.scroll, max(0, len(lines) - room_rows)))
    y = body_top
    for i, text in enumerate(lines[state.scroll : state.scroll + room_rows]):
        bold = table.leaders is not None and table.groups and table.leaders[state.scroll + i]
        attr = curses.A_BOLD if bold else 0
        if selecting and not state.detail and state.scroll + i == state.selected:
            attr = curses.A_STANDOUT
        _put(scr, y, 0, text, width, attr)
        y += 1
    if not lines and not notes:
        _put(scr, y, 0, "(no activity yet)" if state.prev is None else "(no activity)", width)
        y += 1
    if note_lines:
        if lines:
            y += 1
        for text in notes[:note_lines]:
            _put(scr, y, 0, text, width)
            y += 1
    more = len(lines) - state.scroll - room_rows
    help_text = (HELP_STACKS if stacks else HELP_HEAP if state.view == HEAP_VIEW else HELP) + (
        f"  (+{more} rows)" if more > 0 else ""
    )
    _put(scr, height - 1, 0, help_text, width, curses.A_REVERSE)
    scr.refresh()


def _put(scr: curses.window, y: int, x: int, text: str, width: int, attr: int = 0) -> None:
    # every line drawn, escaped: curses would pass a name's \n, \b, \t (and C1 codes) on
    text = printable(text)
    try:
        scr.addnstr(y, x, text, max(0, width - x - (1 if y == scr.getmaxyx()[0] - 1 else 0)), attr)
    except curses.error:  # writing into the bottom-right cell, or a resize race
        pass


def _loop(scr: curses.window, source: Callable[[], Optional[Snapshot]], state: State) -> int:
    try:
        curses.curs_set(0)
    except curses.error:
        pass
    scr.keypad(True)
    try:
        state.push(source())
    except StopIteration:
        return 0
    draw(scr, state, state.table())
    next_at = time.monotonic() + state.interval
    while not state.quit:
        wait = next_at - time.monotonic()
        scr.timeout(max(0, int(wait * 1000)))
        ch = scr.getch()
        if ch == -1:
            if time.monotonic() < next_at:
                continue
            next_at = max(next_at + state.interval, time.monotonic() + state.interval / 10)
            if state.paused:
                continue
            try:
                state.push(source())
            except StopIteration:
                return 0
        elif not state.key(ch):
            continue
        if state.quit:
            break
        draw(scr, state, state.table())
    return 0


def run(
    source: Callable[[], Optional[Snapshot]], interval: Optional[float] = None, view: Union[int, str, None] = None
) -> int:
    """Show the live view until q, Ctrl-C or SIGTERM; returns the exit code (0). INTERVAL:
    seconds between refreshes (default 1); VIEW: the first view (1-6 or a name, default 1)."""
    interval = interval or 1.0
    view = view or 1
    require_terminal()
    state = State(interval=interval, view=views.VIEWS.index(views.view_name(view)))
    previous = signal.getsignal(signal.SIGTERM)
    if previous in (signal.SIG_DFL, signal.SIG_IGN, None):
        signal.signal(signal.SIGTERM, _sigterm)
    try:
        return curses.wrapper(_loop, source, state)
    except KeyboardInterrupt:
        return 0
    except curses.error as exc:
        if "setupterm" in str(exc) or "cbreak" in str(exc) or "initscr" in str(exc):
            raise PymtraceError(
                f"cannot start the full-screen view on this terminal "
                f"(TERM={os.environ.get('TERM', '')!r}: {exc}); use --batch"
            ) from None
        raise
    finally:
        if previous in (signal.SIG_DFL, signal.SIG_IGN, None):
            signal.signal(signal.SIGTERM, previous or signal.SIG_DFL)


def require_terminal() -> None:
    """Raise PymtraceError unless stdin and stdout are a terminal (call it before attaching)."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise PymtraceError("the full-screen view needs a terminal; use --batch or --json for output to a pipe or file")


def _sigterm(signum: int, frame: Optional[FrameType]) -> NoReturn:
    raise KeyboardInterrupt
