"""RunCheckpointer: keeps the last k steps, restores the latest complete one, ignores a crashed save."""

import jax.numpy as jnp
import numpy as np
import pytest

from fastrl_jax.checkpoint import RunCheckpointer


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


def test_restore_from_an_empty_directory_says_so(tmp_path):
    with RunCheckpointer(tmp_path) as ckpt, pytest.raises(FileNotFoundError, match="no checkpoint"):
        ckpt.restore(None, {"policy": {"w": jnp.zeros(2)}})
