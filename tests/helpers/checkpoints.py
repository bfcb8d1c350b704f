"""Damaging a checkpoint the way a full disk or an interrupted copy does, for the resume tests."""

from pathlib import Path


def damage(step_dir: Path) -> None:
    """Cuts the largest file of a checkpoint step in half, as a full disk or an interrupted copy leaves it."""
    files = [p for p in Path(step_dir).rglob("*") if p.is_file()]
    biggest = max(files, key=lambda p: p.stat().st_size)
    with open(biggest, "r+b") as f:
        f.truncate(biggest.stat().st_size // 2)


def kill_writes_half_way(monkeypatch) -> None:
    """Path.write_text writes half its text, then the process 'dies' (KeyboardInterrupt): a kill mid-write.
    monkeypatch.undo() ends it."""
    write_text = Path.write_text

    def killed(self, text, *args, **kwargs):
        write_text(self, text[: len(text) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", killed)
