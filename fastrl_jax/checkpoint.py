"""Orbax step-numbered run checkpoints for training (policy, optimizer, drafter, data position)."""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import logging
import shutil
import sys
import zipfile
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from fastrl_jax.files import replacing
from fastrl_jax.sharding import allgather_json

log = logging.getLogger(__name__)


def write_arrays(path: str | Path, arrays: dict[str, np.ndarray]) -> None:
    """Named numpy arrays into one .npz file, atomically (a temporary file, then a rename)."""
    with replacing(path) as tmp:
        np.savez(tmp, **arrays)


def read_arrays(path: str | Path) -> dict[str, np.ndarray]:
    """The arrays of a write_arrays file. FileNotFoundError when it is missing, ValueError when it is no .npz file
    (numpy would call a damaged one pickled data)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path} not found")
    if not zipfile.is_zipfile(path):
        raise ValueError("not an .npz file")
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def write_step_file(directory: Path, step: int, arrays: dict[str, np.ndarray], keep: set[int]) -> None:
    """Host state too large for a checkpoint's JSON, beside checkpoint `step` as DIRECTORY/STEP.npz (write_arrays);
    the files of steps not in `keep` (the checkpoints on disk) and a killed write's leftovers are removed."""
    directory.mkdir(parents=True, exist_ok=True)
    write_arrays(directory / f"{step}.npz", arrays)
    prune_step_files(directory, keep)


def prune_step_files(directory: Path, keep: Collection[int]) -> None:
    """Removes DIRECTORY's write_step_file files of steps not in `keep`, and a killed write's leftovers."""
    for f in directory.glob("*.npz"):
        if not (f.stem.isdigit() and int(f.stem) in keep):
            f.unlink(missing_ok=True)


def read_step_file(load: Callable[[Path], Any], path: Path) -> str | None:
    """load(path) of a write_step_file file: None when it read, else why not, for the caller's message (such
    state is lost with no harm to correctness: it starts empty and refills)."""
    try:
        load(path)
    except FileNotFoundError:
        return "none was saved with it"
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:  # damaged, or another run's layout
        return f"{path} is unreadable: {e}"
    return None


class UnreadableCheckpoint(ValueError):
    """A checkpoint step (or every step) could not be read back; the message names the steps, why, and the fix."""


def checkpoint_steps(run_dir: str | Path) -> list[int]:
    """The complete checkpoint steps in RUN_DIR/checkpoints, without opening Orbax (a step's directory
    is renamed to its number only when complete)."""
    return _complete_steps(Path(run_dir).expanduser() / "checkpoints")


def _complete_steps(directory: Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir()) if directory.is_dir() else []


class RunCheckpointer:
    """Step-numbered checkpoints of a training run: async, atomic, keeps the last `keep`.

    A checkpoint is a dict of named items. Array pytrees are saved with Orbax's
    StandardSave (sharded arrays restore onto the shardings of the abstract target), plain
    JSON-able dicts (data iterator position, metrics, RNG seeds) with JsonSave. Orbax writes
    each step into a temporary directory and renames it when complete, so a crash or a full
    disk mid-save leaves the previous checkpoint as the latest valid one; a writer removes the
    temporary directories that crashed or failed saves left (each as large as a checkpoint) when
    it opens and when a save fails.
    """

    def __init__(self, directory: str | Path, keep: int | None = 3, async_save: bool = True, read_only: bool = False):
        """keep: steps kept (None: all); read_only: for reading a run's checkpoints (nothing is created or deleted)."""
        self.directory = Path(directory).expanduser().resolve()
        if not read_only:
            self._remove_unfinished_saves()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                                 read_only=read_only, create=not read_only),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """The checkpoint steps on disk. While a save is in flight Orbax lists its step and no longer the older
        steps it prunes once complete: those are listed too (the latest valid checkpoints until then, and after
        it if it fails)."""
        return sorted(set(self._manager.all_steps()) | set(_complete_steps(self.directory)))

    def items(self, step: int) -> set[str]:
        """The names of the items saved at `step` (Orbax writes each item of a step into its own directory)."""
        return {p.name for p in (self.directory / str(step)).iterdir() if p.is_dir()}

    def read_meta(self, step: int, name: str) -> dict[str, Any] | None:
        """One JSON item of `step`, or None when it does not read back."""
        try:
            with _reading(self.directory / str(step)):
                return self._manager.restore(step, args=ocp.args.Composite(**{name: ocp.args.JsonRestore()}))[name]
        except Exception:  # noqa: BLE001 - a damaged step: restore() reports it
            return None

    def save(self, step: int, arrays: dict[str, Any], meta: dict[str, Any] | None = None) -> None:
        """Starts saving `arrays` (name -> pytree of arrays) and `meta` (name -> JSON-able dict)
        as `step`; returns once the arrays are copied off device (the write continues behind). A step at or below
        the latest is a ValueError."""
        items = {name: ocp.args.StandardSave(tree) for name, tree in arrays.items()}
        items |= {name: ocp.args.JsonSave(value) for name, value in (meta or {}).items()}
        with self._failed_writes():
            saved = self._manager.save(step, args=ocp.args.Composite(**items))
        if not saved:  # Orbax skips a step at or below its latest without a word
            raise ValueError(f"checkpoint step {step} was not saved: {self.directory} holds step {self.latest_step()}, "
                             "and a checkpoint step must come after the latest")

    def restore(
        self, step: int | None, arrays: dict[str, Any], meta: Sequence[str] = (), optional: Collection[str] = ()
    ) -> tuple[int, dict[str, Any], dict[str, Any]]:
        """Restores `step`, or with None the latest step that reads back (newer unreadable ones are
        skipped with a warning that names them). `arrays` maps names to abstract targets (pytrees of
        jax.ShapeDtypeStruct with shardings, or concrete arrays to mirror). Returns (step, arrays, meta);
        an `optional` item that the step restored does not hold is left out of them (each step is asked
        for what it holds: an older step may lack what the run turned on later, or hold what it turned off).

        Raises FileNotFoundError when there is no checkpoint, UnreadableCheckpoint when the step (or
        every step) fails to read."""
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        if step is not None and step not in steps:
            raise FileNotFoundError(f"no checkpoint step {step} in {self.directory}; its steps: {_listed(steps)}")
        failures: list[tuple[int, str]] = []
        for candidate in [step] if step is not None else steps[::-1]:
            why = None
            try:
                held = self.items(candidate) if optional else set()
                with _reading(self.directory / str(candidate)):
                    restored = self._restore(candidate, {n: a for n, a in arrays.items() if n not in optional or n in held},
                                             [n for n in meta if n not in optional or n in held])
            except Exception as e:  # noqa: BLE001 - Orbax/TensorStore raise bare Exceptions for damaged files
                why = _first_line(e)
            # Each process reads only its own shards: one that cannot read its part fails every process's
            # restore of that step, else processes would go on from different steps.
            why = _first_failure(why)
            if why is not None:
                failures.append((candidate, why))
                continue
            for bad, why in failures:
                log.warning("checkpoint step %d in %s is unreadable (%s); using step %d", bad, self.directory, why, candidate)
            return candidate, *restored
        raise UnreadableCheckpoint(_unreadable_message(self.directory, failures, steps, step is not None))

    def _restore(self, step: int, arrays: dict[str, Any], meta: Sequence[str]) -> tuple[dict, dict]:
        targets = {name: jax.tree.map(_abstract, tree) for name, tree in arrays.items()}
        items = {name: ocp.args.StandardRestore(tree) for name, tree in targets.items()}
        items |= {name: ocp.args.JsonRestore() for name in meta}
        # The handler, not the manager: the manager's restore ends in a barrier that a process whose read failed
        # never reaches, and restore() agrees on the outcome in its own collective.
        handler = ocp.CompositeCheckpointHandler()
        try:
            restored = handler.restore(self.directory / str(step), args=ocp.args.Composite(**items))
        finally:
            handler.close()
        return {n: restored[n] for n in arrays}, {n: restored[n] for n in meta}

    def set_aside(self, steps: Sequence[int]) -> Path | None:
        """Moves the given step directories (unreadable ones) out of the way, into DIR.unreadable/ (as STEP, or
        STEP.N when an earlier copy of that step is there: none is deleted), so later saves of those step numbers
        are written afresh; returns where they went. Every process calls it (process 0 moves, all re-read the step
        list)."""
        if not steps:
            return None
        where = self.directory.parent / f"{self.directory.name}.unreadable"
        if jax.process_index() == 0:
            where.mkdir(exist_ok=True)
            for step in steps:
                target = where / str(step)
                for n in itertools.count(1):
                    if not target.exists():
                        break
                    target = where / f"{step}.{n}"
                (self.directory / str(step)).rename(target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("fastrl-jax checkpoint steps set aside")
        self._manager.reload()
        return where

    def wait(self) -> None:
        """Blocks until the last save is on disk."""
        with self._failed_writes():
            self._manager.wait_until_finished()

    def close(self) -> None:
        self.wait()
        self._manager.close()

    @contextlib.contextmanager
    def _failed_writes(self):
        """A failed save (reported at the next save or wait) as _disk_errors says. Orbax has by then dropped
        the failed step from its list of steps, and with it the older steps that save was to prune: those are
        still on disk (the newest valid checkpoints) and would never be pruned, so the list is read again.
        The failed save's temporary directory is removed: training goes on, and it would hold space (a full
        disk's) the next save needs."""
        try:
            with _disk_errors():
                yield
        except Exception:
            with contextlib.suppress(OSError):  # a directory that cannot be listed: the write's error says more
                self._manager.reload()
                if not self._manager.is_saving_in_progress():  # a save refused before it waited for the previous one
                    self._remove_unfinished_saves()
            raise

    def _remove_unfinished_saves(self) -> None:
        """Removes the temporary directories of saves that never completed (process 0; each as large as a
        checkpoint). Not Orbax's cleanup_tmp_directories: one it cannot remove (another user's files) fails
        every save."""
        if jax.process_index() == 0 and self.directory.is_dir():
            for path in self.directory.iterdir():
                if ocp.utils.is_tmp_checkpoint(path):
                    shutil.rmtree(path, ignore_errors=True)

    def __enter__(self) -> "RunCheckpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


@contextlib.contextmanager
def damage_reported(path: Path):
    """Around an Orbax read of the checkpoint at `path` whose structure is known to fit: what the read raises (Orbax
    and TensorStore raise bare Exceptions for a damaged file) comes out as one UnreadableCheckpoint naming it."""
    try:
        with _reading(path):
            yield
    except Exception as e:  # noqa: BLE001
        raise UnreadableCheckpoint(f"{path} is unreadable ({_first_line(e)}): its files are damaged (a full disk, a "
                                   "copy cut short); copy it again, or give another checkpoint") from None


# "'STEP_DIR/" of each checkpoint step being read, or whose read failed and left reads pending (_reading)
_ABANDONED: set[str] = set()


@contextlib.contextmanager
def _reading(step_dir: Path):
    """Around a read of a checkpoint step. Orbax stops restoring a step at its first unreadable array and leaves
    that step's other reads pending; what they print later is about damage the caller already reports, and is
    dropped (_quiet_abandoned_reads). The filters go in before the read, since the first of them print as it
    fails."""
    _quiet_abandoned_reads()
    marker = f"'{step_dir}/"
    _ABANDONED.add(marker)
    yield
    _ABANDONED.discard(marker)  # not reached when the read raises: its pending reads stay quiet


@functools.cache
def _quiet_abandoned_reads() -> None:
    """Installs, once, filters for what a failed read's pending reads print: "Exception ignored in: <coroutine
    ...>" (sys.unraisablehook) and asyncio's "... exception was never retrieved" (its logger), each with a page
    of TensorStore spec naming a file of such a step; and the bare "Event loop is closed" tracebacks
    (sys.unraisablehook) of TensorStore's threads posting a finished read to the failed restore's closed event
    loop (call_soon_threadsafe with no Python caller). Everything else passes."""
    previous = sys.unraisablehook

    def abandoned(text: str) -> bool:
        return any(marker in text for marker in _ABANDONED)

    def posted_late(u) -> bool:
        tb = u.exc_traceback
        return (u.exc_type is RuntimeError and str(u.exc_value) == "Event loop is closed" and tb is not None
                and tb.tb_frame.f_code.co_name == "call_soon_threadsafe" and bool(_ABANDONED))

    def unraisable(u):
        if not (abandoned(str(u.exc_value)) or posted_late(u)):
            previous(u)

    def asyncio_record(record: logging.LogRecord) -> bool:
        return not abandoned(record.getMessage() + (str(record.exc_info[1]) if record.exc_info else ""))

    sys.unraisablehook = unraisable
    logging.getLogger("asyncio").addFilter(asyncio_record)


@contextlib.contextmanager
def _disk_errors():
    """A full disk as OSError: Orbax's background write reports it as TensorStore's ValueError
    ('RESOURCE_EXHAUSTED ... No space left on device') at the next save or wait."""
    try:
        yield
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - matched on the storage error's text, re-raised otherwise
        for text, code in (("No space left on device", errno.ENOSPC), ("Disk quota exceeded", errno.EDQUOT)):
            if text in str(e):
                raise OSError(code, f"{text}: {_first_line(e)}") from e
        raise


def _first_failure(why: str | None) -> str | None:
    """`why` (None: this process succeeded) as every process agrees on it: a failure on any process fails
    them all (with this process's reason, else another's)."""
    if jax.process_count() == 1:
        return why
    failed = [w for w in allgather_json(why) if w is not None]
    return why if why is not None else f"on another process: {failed[0]}" if failed else None


def _first_line(e: BaseException) -> str:
    """The root cause's type and first line: TensorStore's own error names the damaged file."""
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def _listed(steps: Sequence[int]) -> str:
    return ", ".join(map(str, steps)) or "none"


def _unreadable_message(directory: Path, failures: list[tuple[int, str]], steps: list[int], explicit: bool) -> str:
    why = "; ".join(f"step {s}: {reason}" for s, reason in failures)
    if explicit:
        others = [s for s in steps if s != failures[0][0]]
        return (f"checkpoint step {failures[0][0]} in {directory} is unreadable ({why}); "
                f"other steps: {_listed(others)}")
    return (f"no checkpoint in {directory} reads back ({why}), and no earlier step is left to fall back to: its "
            "files are damaged (a full disk, a copy cut short), or the config no longer matches the run's")
