"""OwnedDirectory (mcore_reshard/util/owned_dir.py), the export's output directory: one writer at a time, left
complete or as it was.  In process, plus one plain Python child that holds the lock and is then SIGKILLed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from mcore_reshard.util.owned_dir import DirectoryBusy, OwnedDirectory

MODULE = os.path.join(os.path.dirname(__file__), "..", "..", "mcore_reshard", "util", "owned_dir.py")
HOLDER = f"""
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("owned_dir", {os.path.abspath(MODULE)!r})
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
d = m.OwnedDirectory(sys.argv[1], what="the holder in a test").acquire()
open(os.path.join(d.staging, "model-00001-of-00002.safetensors"), "w").write("half")
print("ready", flush=True)
time.sleep(600)
"""


def _export_file(name: str) -> bool:
    return name.endswith(".safetensors") or name in ("model.safetensors.index.json", "config.json")


def _write(d: OwnedDirectory, files: dict) -> None:
    for name, text in files.items():
        with open(os.path.join(d.staging, name), "w") as f:
            f.write(text)


def _contents(path: str) -> dict:
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            full = os.path.join(root, f)
            out[os.path.relpath(full, path)] = open(full).read()
    return out


def _hidden(tmp_path) -> list:
    return sorted(f for f in os.listdir(tmp_path) if f.startswith("."))


def test_commit_replaces_the_export_and_carries_the_rest_over(tmp_path):
    out = str(tmp_path / "model")
    with OwnedDirectory(out, owned=_export_file) as d:
        _write(d, {"config.json": "A", "model-00001-of-00002.safetensors": "A1", "model-00002-of-00002.safetensors": "A2"})
        assert not os.path.exists(out)                        # nothing visible before the commit
    assert _contents(out) == {"config.json": "A", "model-00001-of-00002.safetensors": "A1",
                              "model-00002-of-00002.safetensors": "A2"}
    os.makedirs(os.path.join(out, "extra"))
    (tmp_path / "model" / "extra" / "notes.txt").write_text("user")
    (tmp_path / "model" / "tokenizer.json").write_text("user")
    with OwnedDirectory(out, owned=_export_file) as d:
        _write(d, {"config.json": "B", "model.safetensors": "B"})
        assert _contents(out)["config.json"] == "A"            # A until B is complete
    assert _contents(out) == {"config.json": "B", "model.safetensors": "B", "tokenizer.json": "user",
                              "extra/notes.txt": "user"}      # A's two shards gone, the user's files kept
    assert _hidden(tmp_path) == []                             # no lock, no staging, no old directory left


def test_abort_leaves_the_directory_as_it_was(tmp_path):
    out = str(tmp_path / "model")
    with OwnedDirectory(out) as d:
        _write(d, {"config.json": "A"})
    with pytest.raises(RuntimeError, match="injected"):
        with OwnedDirectory(out) as d:
            _write(d, {"config.json": "B", "model.safetensors": "B"})
            raise RuntimeError("injected")
    assert _contents(out) == {"config.json": "A"} and _hidden(tmp_path) == []
    with pytest.raises(NotADirectoryError):
        OwnedDirectory(str(tmp_path / "model" / "config.json")).acquire()


def test_a_second_writer_is_refused_and_a_killed_one_leaves_the_directory_unchanged(tmp_path):
    out = str(tmp_path / "model")
    with OwnedDirectory(out) as d:
        _write(d, {"config.json": "A"})
    child = subprocess.Popen([sys.executable, "-c", HOLDER, out], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        with pytest.raises(DirectoryBusy) as e:
            OwnedDirectory(out).acquire()
        msg = str(e.value)
        assert f"{out} is being written by another writer (pid {child.pid} on host" in msg, msg
        assert "the holder in a test" in msg and time.monotonic() - t0 < 1.0, msg
        assert _contents(out) == {"config.json": "A"}
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    assert any(".staging-" in f for f in _hidden(tmp_path))   # the killed writer's half-written staging ...
    assert _contents(out) == {"config.json": "A"}              # ... never visible in the directory
    d = OwnedDirectory(out).acquire()                          # the kernel released its lock
    assert [f for f in _hidden(tmp_path) if ".staging-" in f] == [os.path.basename(d.staging)]   # cleaned
    d.abort()
    assert _contents(out) == {"config.json": "A"} and _hidden(tmp_path) == []


def test_a_swap_cut_between_its_renames_is_undone_by_the_next_writer(tmp_path):
    out = str(tmp_path / "model")
    with OwnedDirectory(out) as d:
        _write(d, {"config.json": "A"})
    os.rename(out, str(tmp_path / ".model.old-123"))          # a writer killed right after its first rename
    d = OwnedDirectory(out).acquire()
    assert _contents(out) == {"config.json": "A"}
    d.abort()
    assert _hidden(tmp_path) == []
