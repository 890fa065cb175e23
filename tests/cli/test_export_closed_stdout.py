"""`relax-export ... | head` (or `| true`): the export is written, and its summary goes to a pipe whose reader is gone.
relax-export exits 0, as for a written export, and prints nothing on stderr; before, the summary's print raised
BrokenPipeError: a traceback and exit 1, which relax-export documents as "a write failed".

A relax-export process whose export is a stand-in (the same function, written and returned at once), its stdout a
pipe whose read end is closed before it starts, so that its first write finds no reader whatever the timing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path

    import relax.cli.export as cli

    def export_checkpoint(checkpoint, out_dir, **_):
        Path(out_dir).mkdir()
        (Path(out_dir) / "model.safetensors").write_bytes(b"written")
        return "result"

    cli.export_checkpoint = export_checkpoint
    cli.summary = lambda result: "exported\\n" * 20000  # more than a pipe holds: written in several writes
    cli.main(sys.argv[1:])
""")


def _export(tmp_path: Path, *, reader: bool) -> tuple[int, str]:
    read, write = os.pipe()
    if not reader:
        os.close(read)
    try:
        proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path / "ckpt"), str(tmp_path / "out")],
                                stdout=write, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    finally:
        os.close(write)
    if reader:
        with os.fdopen(read) as f:
            assert f.read().startswith("exported\n")
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err


def test_a_closed_stdout_after_a_written_export_exits_0_quietly(tmp_path: Path):
    code, err = _export(tmp_path, reader=False)
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == b"written"
    assert (code, err) == (0, "")
    # control: with a reader, the summary is read whole and the exit is 0 too
    (tmp_path / "out" / "model.safetensors").unlink()
    (tmp_path / "out").rmdir()
    assert _export(tmp_path, reader=True) == (0, "")
