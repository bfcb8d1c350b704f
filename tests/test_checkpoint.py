"""RunCheckpointer: keeps the last k steps, restores the latest complete one, ignores a crashed save."""

import errno
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from helpers.checkpoints import damage

from fastrl_jax.checkpoint import RunCheckpointer, UnreadableCheckpoint, read_arrays, write_arrays, write_step_file
from fastrl_jax.files import replacing


def test_keeps_last_k_and_restores_latest(tmp_path):
    with RunCheckpointer(tmp_path, keep=2) as ckpt:
        for step in range(4):
            ckpt.save(step, {"policy": {"w": jnp.full(3, float(step))}}, {"data": {"position": step}})
        ckpt.wait()
        step, arrays, meta = ckpt.restore(None, {"policy": {"w": jnp.zeros(3)}}, ["data"])
    assert step == 3
    np.testing.assert_array_equal(arrays["policy"]["w"], np.full(3, 3.0))
    assert meta == {"data": {"position": 3}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "3"]


def test_a_step_at_or_below_the_latest_is_refused_not_skipped(tmp_path):
    with RunCheckpointer(tmp_path, keep=2) as ckpt:
        ckpt.save(3, {"policy": {"w": jnp.full(3, 3.0)}})
        ckpt.wait()
        for step in (3, 2):
            with pytest.raises(ValueError, match=f"step {step} was not saved: .* holds step 3"):
                ckpt.save(step, {"policy": {"w": jnp.zeros(3)}})
        ckpt.wait()
        _, arrays, _ = ckpt.restore(None, {"policy": {"w": jnp.zeros(3)}})
    np.testing.assert_array_equal(arrays["policy"]["w"], np.full(3, 3.0))


def test_an_unfinished_save_is_not_a_checkpoint(tmp_path):
    with RunCheckpointer(tmp_path, keep=3) as ckpt:
        ckpt.save(1, {"policy": {"w": jnp.ones(2)}})
    # What a process killed mid-save leaves behind: Orbax's temporary directory, never renamed.
    (tmp_path / "2.orbax-checkpoint-tmp-1234").mkdir()
    with RunCheckpointer(tmp_path, keep=3) as ckpt:
        assert ckpt.latest_step() == 1
        step, arrays, _ = ckpt.restore(None, {"policy": {"w": jnp.zeros(2)}})
    assert step == 1
    np.testing.assert_array_equal(arrays["policy"]["w"], np.ones(2))


def test_a_writer_removes_what_a_killed_save_left(tmp_path):
    """A killed save leaves a temporary directory as large as a checkpoint: the next writer removes it, a reader
    (export, eval) leaves it alone (the run may still be writing it)."""
    with RunCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, {"policy": {"w": jnp.ones(2)}})
    killed = tmp_path / "2.orbax-checkpoint-tmp-1234"
    (killed / "policy").mkdir(parents=True)
    (killed / "policy" / "d").write_bytes(bytes(4096))
    with RunCheckpointer(tmp_path, read_only=True) as reader:
        assert reader.latest_step() == 1
    assert killed.is_dir()
    with RunCheckpointer(tmp_path) as ckpt:
        ckpt.save(2, {"policy": {"w": jnp.full(2, 2.0)}})
    assert not killed.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]


def test_a_failed_background_write_keeps_the_older_step_listed_and_prunes_it_later(tmp_path, monkeypatch):
    """Step 2's write fails at its final rename (as a full disk fails any write of it). Orbax had already dropped
    step 1, which that save was to prune, from its list of steps: step 1 is still the latest checkpoint (the
    trainer's messages name it), and the next good save prunes it."""
    rename = os.rename

    def full_disk(src, dst, *args, **kwargs):
        if Path(dst).name == "2":
            raise OSError(errno.ENOSPC, "No space left on device")
        return rename(src, dst, *args, **kwargs)

    with RunCheckpointer(tmp_path, keep=1) as ckpt:
        ckpt.save(1, {"policy": {"w": jnp.ones(2)}})
        ckpt.wait()
        monkeypatch.setattr(os, "rename", full_disk)
        ckpt.save(2, {"policy": {"w": jnp.full(2, 2.0)}})
        with pytest.raises(OSError) as raised:
            ckpt.wait()
        monkeypatch.undo()
        assert raised.value.errno == errno.ENOSPC
        assert ckpt.all_steps() == [1] and ckpt.latest_step() == 1
        # Training goes on: the failed save's temporary directory would hold space the next save needs.
        assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]
        ckpt.save(3, {"policy": {"w": jnp.full(2, 3.0)}})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3"]


def test_a_full_disk_in_the_background_write_is_an_os_error(tmp_path, monkeypatch):
    """Orbax reports a background write that ran out of space as TensorStore's ValueError at the next save
    or wait; the trainer keeps training on OSError (disk full), so the checkpointer raises that."""
    ckpt = RunCheckpointer(tmp_path, keep=2)
    full = ValueError("RESOURCE_EXHAUSTED: Error writing local file \"/run/ckpt/2/policy/d/0\": [OS error 28] "
                      "No space left on device")
    monkeypatch.setattr(ckpt._manager, "wait_until_finished", lambda: (_ for _ in ()).throw(full))
    with pytest.raises(OSError) as raised:
        ckpt.wait()
    assert raised.value.errno == errno.ENOSPC and raised.value.__cause__ is full
    monkeypatch.setattr(ckpt._manager, "wait_until_finished", lambda: (_ for _ in ()).throw(ValueError("a bug")))
    with pytest.raises(ValueError, match="a bug"):
        ckpt.wait()


def test_restore_from_an_empty_directory_says_so(tmp_path):
    with RunCheckpointer(tmp_path) as ckpt, pytest.raises(FileNotFoundError, match="no checkpoint"):
        ckpt.restore(None, {"policy": {"w": jnp.zeros(2)}})


def _save_steps(directory, steps, keep=3):
    rng = np.random.default_rng(0)
    with RunCheckpointer(directory, keep=keep) as ckpt:
        for step in steps:  # random values: compressed, ones would fit a file too small to damage
            ckpt.save(step, {"policy": {"w": jnp.asarray(rng.random((256, 256), np.float32)) + step}})


def test_a_damaged_latest_step_falls_back_to_the_previous_one_and_says_so(tmp_path, caplog):
    _save_steps(tmp_path, [1, 2])
    damage(tmp_path / "2")
    with RunCheckpointer(tmp_path) as ckpt:
        step, arrays, _ = ckpt.restore(None, {"policy": {"w": jnp.zeros((256, 256))}})
        assert step == 1 and float(arrays["policy"]["w"].min()) >= 1
        assert "checkpoint step 2 in" in caplog.text and "is unreadable" in caplog.text and "using step 1" in caplog.text
        with pytest.raises(UnreadableCheckpoint, match="checkpoint step 2 in .* is unreadable .*other steps: 1"):
            ckpt.restore(2, {"policy": {"w": jnp.zeros((256, 256))}})
        with pytest.raises(FileNotFoundError, match="no checkpoint step 7 .*its steps: 1, 2"):
            ckpt.restore(7, {"policy": {"w": jnp.zeros((256, 256))}})
        ckpt.set_aside([2])
        assert ckpt.all_steps() == [1]
        ckpt.save(2, {"policy": {"w": jnp.full((256, 256), 5.0)}})  # the step number is free again
        ckpt.wait()
        step, arrays, _ = ckpt.restore(None, {"policy": {"w": jnp.zeros((256, 256))}})
        assert step == 2 and float(arrays["policy"]["w"][0, 0]) == 5.0
        ckpt.set_aside([2])  # a second copy of step 2 set aside keeps the first
    aside = tmp_path.parent / f"{tmp_path.name}.unreadable"
    assert sorted(p.name for p in aside.iterdir()) == ["2", "2.1"]  # set aside, not deleted


def test_optional_items_are_asked_of_the_step_that_reads_back(tmp_path):
    """A run turned the drafter on at step 2, whose checkpoint is damaged: the fallback to step 1 restores what
    step 1 holds (no drafter) instead of failing every step for the drafter it never had; and a step holding
    an optional item restores it."""
    w = jnp.asarray(np.random.default_rng(0).random((256, 256), np.float32))  # random: compressed, it stays damageable
    with RunCheckpointer(tmp_path, keep=3) as ckpt:
        ckpt.save(1, {"policy": {"w": w + 1}}, {"data": {"position": 1}})
        ckpt.save(2, {"policy": {"w": w + 2}, "drafter": {"w": jnp.full(2, 2.0)}}, {"data": {"position": 2}, "history": {"n": 2}})
        ckpt.wait()
        want = {"policy": {"w": jnp.zeros((256, 256))}, "drafter": {"w": jnp.zeros(2)}}
        step, arrays, meta = ckpt.restore(None, want, ["data", "history"], optional=("drafter", "history"))
        assert step == 2 and float(arrays["drafter"]["w"][0]) == 2.0 and meta["history"] == {"n": 2}
    damage(tmp_path / "2")
    with RunCheckpointer(tmp_path, keep=3) as ckpt:
        step, arrays, meta = ckpt.restore(None, want, ["data", "history"], optional=("drafter", "history"))
    assert step == 1 and set(arrays) == {"policy"} and meta == {"data": {"position": 1}}
    np.testing.assert_array_equal(arrays["policy"]["w"], w + 1)


def test_what_a_failed_reads_pending_reads_print_later_is_dropped_and_nothing_else(tmp_path, monkeypatch, caplog):
    """A damaged step's restore fails at its first unreadable array; its other reads finish later on TensorStore's
    threads and print tracebacks (2026-11-27: 'Event loop is closed' after the CLI's clear error, 1 run in 4):
    those are dropped, other unraisable exceptions and asyncio errors still show."""
    import asyncio
    import logging
    import types

    from fastrl_jax import checkpoint

    shown = []
    monkeypatch.setattr(sys, "unraisablehook", shown.append)
    monkeypatch.setattr(logging.getLogger("asyncio"), "filters", [])
    monkeypatch.setattr(checkpoint, "_ABANDONED", set())
    checkpoint._quiet_abandoned_reads.__wrapped__()  # over this test's hook (the process's filters go in once)
    step_dir = tmp_path / "2"
    with pytest.raises(ValueError), checkpoint._reading(step_dir):
        raise ValueError("OUT_OF_RANGE")
    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(print)
    except RuntimeError as e:  # as TensorStore's thread meets it: no Python caller above call_soon_threadsafe
        late = e, e.__traceback__.tb_next
    spec = ValueError(f"Error reading in OCDBT database at local file '{step_dir}/optimizer/'")
    other = ValueError("something else broke")
    for value, tb in (late, (spec, None), (other, None)):
        sys.unraisablehook(types.SimpleNamespace(exc_type=type(value), exc_value=value, exc_traceback=tb, err_msg=None,
                                                 object=None))
    assert [u.exc_value for u in shown] == [other]
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        logging.getLogger("asyncio").error("Future exception was never retrieved", exc_info=(ValueError, spec, None))
        logging.getLogger("asyncio").error("Task exception was never retrieved", exc_info=(ValueError, other, None))
    assert [r.exc_info[1] for r in caplog.records] == [other]


def test_no_readable_step_is_one_clear_error(tmp_path):
    _save_steps(tmp_path, [3], keep=1)
    damage(tmp_path / "3")
    with RunCheckpointer(tmp_path, keep=1) as ckpt, pytest.raises(UnreadableCheckpoint) as e:
        ckpt.restore(None, {"policy": {"w": jnp.zeros((256, 256))}})
    message = str(e.value)
    assert "step 3: ValueError: OUT_OF_RANGE" in message and "no earlier step is left to fall back to" in message
    assert len(message.splitlines()) == 1


def test_a_failed_write_leaves_the_previous_file_whole_and_nothing_beside_it(tmp_path):
    write_arrays(tmp_path / "3.npz", {"a": np.arange(3)})
    with pytest.raises(ZeroDivisionError):
        with replacing(tmp_path / "3.npz") as tmp:
            tmp.write_bytes(b"half a fi")
            1 / 0
    assert [p.name for p in tmp_path.iterdir()] == ["3.npz"]
    np.testing.assert_array_equal(read_arrays(tmp_path / "3.npz")["a"], np.arange(3))


def test_a_write_removes_what_killed_writes_of_the_same_file_on_this_host_left(tmp_path):
    """A killed dequantization of a GGUF left its 0.5 GB temporary in the cache for good."""
    host = socket.gethostname()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    orphan, other_host, live, other_file = (tmp_path / n for n in (
        f".m.f32.safetensors.{host}.{gone}.tmp.safetensors", f".m.f32.safetensors.elsewhere.{gone}.tmp.safetensors",
        f".m.f32.safetensors.{host}.{os.getppid()}.tmp.safetensors", f".n.f32.safetensors.{host}.{gone}.tmp.safetensors"))
    recent = tmp_path / f".m.f32.safetensors.{host}.{gone}.recent.tmp.safetensors"
    for f in (orphan, other_host, live, other_file, recent):
        f.write_bytes(b"killed mid-write")
        if f != recent:  # untouched for two hours
            os.utime(f, (time.time() - 7200,) * 2)
    with replacing(tmp_path / "m.f32.safetensors") as tmp:
        tmp.write_bytes(b"whole")
    # Another host's may be under way, as may a running process's, and a recent one of a process this one cannot see
    # (another container with this host name)
    kept = [other_host, live, other_file, recent]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f.name for f in kept] + ["m.f32.safetensors"])


def test_step_files_of_dropped_steps_and_a_killed_writes_leftovers_are_removed(tmp_path):
    for step in (1, 2):
        write_step_file(tmp_path, step, {"a": np.arange(step)}, keep={1, 2})
    (tmp_path / ".3.npz.999.tmp.npz").write_bytes(b"killed mid-write")
    write_step_file(tmp_path, 3, {"a": np.arange(3)}, keep={2, 3})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2.npz", "3.npz"]


def test_a_save_in_flight_keeps_the_steps_it_would_prune_listed(tmp_path, monkeypatch):
    """While step 2 is written, step 1 (which it prunes when complete) is still the latest valid checkpoint: the
    files kept beside the checkpoints on disk (write_step_file's `keep`) must keep its own, in case step 2 fails."""
    rename, release = os.rename, threading.Event()

    def slow_full_disk(src, dst, *args, **kwargs):
        if Path(dst).name == "2":
            release.wait(30)
            raise OSError(errno.ENOSPC, "No space left on device")
        return rename(src, dst, *args, **kwargs)

    with RunCheckpointer(tmp_path / "checkpoints", keep=1) as ckpt:
        ckpt.save(1, {"policy": {"w": jnp.ones(2)}})
        write_step_file(tmp_path / "history", 1, {"a": np.arange(1)}, {1, *ckpt.all_steps()})
        ckpt.wait()
        monkeypatch.setattr(os, "rename", slow_full_disk)
        ckpt.save(2, {"policy": {"w": jnp.full(2, 2.0)}})
        assert ckpt.all_steps() == [1, 2]
        write_step_file(tmp_path / "history", 2, {"a": np.arange(2)}, {2, *ckpt.all_steps()})
        release.set()
        with pytest.raises(OSError):
            ckpt.wait()
        monkeypatch.undo()
        assert ckpt.all_steps() == [1]
    assert sorted(p.name for p in (tmp_path / "history").iterdir()) == ["1.npz", "2.npz"]
