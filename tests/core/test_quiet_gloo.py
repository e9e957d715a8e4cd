"""gloo's C++ connection note is kept out of a process's stdout (jaxdp._quiet_gloo)."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from jaxdp._quiet_gloo import is_gloo_note

# As gloo's C++ streams it: one << per piece, then std::endl.
PIECES = ["[Gloo] Rank ", "1", " is connected to ", "3", " peer ranks. "]
PIECES += ["Expected number of connected peer ranks is : ", "3", "\n"]
NOTE = "".join(PIECES).strip()


@pytest.mark.parametrize(
    "line",
    [
        NOTE,
        "1",  # the stray line that failed a CI run: a cut piece of the note
        "[Gloo] Rank [Gloo] Rank 11 is connected to  is connected to 33 peer ranks. ",
        "Expected number of connected peer ranks is : 3",
        "",  # two notes ended at once: the second newline stands alone
    ],
)
def test_the_note_and_its_pieces_are_recognized(line):
    assert is_gloo_note(line)


@pytest.mark.parametrize("line", ["epoch 1 done: step 8 loss 0.2", "[Gloo] error: x", "a 1"])
def test_other_lines_are_kept(line):
    assert not is_gloo_note(line)


def test_python_output_keeps_its_stream_and_c_output_is_filtered():
    # What gloo does, from C: pieces of its note written to file descriptor 1 from two
    # threads, between the process's own lines; then unflushed C output at exit.
    code = textwrap.dedent(f"""
        import ctypes, os, sys, threading
        from jaxdp._quiet_gloo import quiet_gloo_notes
        assert quiet_gloo_notes()
        libc = ctypes.CDLL(None)
        print("python 1", flush=True)
        def note():
            for piece in {PIECES!r}:
                os.write(1, piece.encode())
        threads = [threading.Thread(target=note) for _ in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        os.write(1, b"\\nfrom C\\n")
        print("python 2")
        libc.printf(b"buffered in C at exit\\n")
    """)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    lines = done.stdout.splitlines()
    assert sorted(lines) == ["buffered in C at exit", "from C", "python 1", "python 2"]
    assert lines.index("python 1") < lines.index("python 2")


def test_unbuffered_output_stays_unbuffered():
    # jaxdp launch runs ranks with PYTHONUNBUFFERED: a rank killed right after printing
    # must not lose its lines in a buffer the filter added.
    code = textwrap.dedent("""
        import os, signal
        from jaxdp._quiet_gloo import quiet_gloo_notes
        assert quiet_gloo_notes()
        print("printed before the kill")
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == -signal.SIGKILL
    assert done.stdout == "printed before the kill\n"


@pytest.mark.parametrize("unbuffered", ["1", ""])
def test_python_lines_and_c_lines_never_mix(unbuffered):
    # Python prints while a C-level writer's lines pass the filter: each line stays whole
    # (unbuffered, print wrote its text and its newline apart, and a C line came between).
    code = textwrap.dedent("""
        import os, threading
        from jaxdp._quiet_gloo import quiet_gloo_notes
        assert quiet_gloo_notes()
        def c_side():
            for i in range(2000):
                os.write(1, f"from C {i}\\n".encode())
        thread = threading.Thread(target=c_side)
        thread.start()
        for i in range(2000):
            print(f"python {i}")
        thread.join()
    """)
    env = dict(os.environ, PYTHONUNBUFFERED=unbuffered)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    expected = [f"{who} {i}" for who in ("from C", "python") for i in range(2000)]
    assert sorted(done.stdout.splitlines()) == sorted(expected)


def test_the_last_output_goes_out_while_a_child_holds_the_pipe():
    # A rank that started a process (a data server) which inherited fd 1: the pipe never
    # ends while it lives, so the filter forwards up to a mark written at exit instead of
    # waiting for the pipe's end (5 s, then the last line, without its newline, was lost).
    code = textwrap.dedent("""
        import ctypes, subprocess, sys
        from jaxdp._quiet_gloo import quiet_gloo_notes
        assert quiet_gloo_notes()
        child = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(120)"], stderr=subprocess.DEVNULL
        )
        print("child", child.pid, flush=True)
        ctypes.CDLL(None).printf(b"from C at exit, no newline")
    """)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline().split()[1])
        try:
            rest = parent.stdout.read()  # to the parent's end: the child holds only the pipe
            assert parent.wait(timeout=60) == 0
        finally:
            os.kill(child, signal.SIGKILL)
    finally:
        parent.kill()
    assert rest == "from C at exit, no newline"
