"""GRPO with bfloat16 rollout engines over float32 master weights (model.rollout_dtype), the precision
config's errors, and online drafter training under mixed precision."""

import gc
import os
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.tiny_run import tiny_overrides

from fastrl_jax.config import ConfigError, check_trainable, load_config
from fastrl_jax.models.decoder import unstack_layers
from fastrl_jax.models.loading import load_model
from fastrl_jax.models.tokenizer import load_tokenizer
from fastrl_jax.rl import update
from fastrl_jax.rl.trainer import Trainer
from fastrl_jax.rl.workers import RolloutWorkers
from fastrl_jax.rollout import engine as engine_module
from fastrl_jax.sharding import make_mesh

BF16 = jnp.bfloat16


def _dtypes(tree) -> set[str]:
    return {str(x.dtype) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}


@pytest.mark.parametrize("overrides, message", [
    (["model.rollout_dtype=float16"], "model.rollout_dtype must be one of '', float32, bfloat16; got 'float16'"),
    (["model.dtype=bfloat16", "model.rollout_dtype=float32"], "model.rollout_dtype=float32 with model.dtype=bfloat16"),
])
def test_precision_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(None, overrides)


def test_training_in_bfloat16_is_refused_with_the_fix():
    cfg = load_config(None, ["model.dtype=bfloat16"])
    assert cfg.model.engine_dtype == "bfloat16"  # inference in bfloat16 is fine
    with pytest.raises(ConfigError, match="model.dtype=float32 and model.rollout_dtype=bfloat16"):
        check_trainable(cfg, "train")
    mixed = load_config(None, ["model.rollout_dtype=bfloat16"])
    check_trainable(mixed, "train")
    assert (mixed.model.dtype, mixed.model.engine_dtype) == ("float32", "bfloat16")


def _trainer(tmp: Path, *extra: str, steps: int = 1) -> Trainer:
    cfg = load_config(None, [*tiny_overrides(tmp, steps), "rl.checkpoint_every_steps=0", *extra])
    model, _ = load_model(cfg.model.path, make_mesh(cfg.mesh), cfg.model.dtype)
    return Trainer(cfg, model, load_tokenizer(Path(cfg.model.path)), stream=open(os.devnull, "w"))


def test_mixed_precision_grpo(tmp_path):
    """bfloat16 engines over float32 master weights split along data: the optimizer state and parameters
    stay float32, the engines get bfloat16 copies at every hand-off, the rollout log-probs stay close to
    the trainer's float32 recomputation, and an update equals the single-dtype trainer's on the same batch."""
    mesh = ["mesh.data=2", "mesh.fsdp=4"]
    mixed = _trainer(tmp_path / "mixed", *mesh, "model.rollout_dtype=bfloat16")
    plain = _trainer(tmp_path / "plain", *mesh)
    try:
        leaf = mixed.params["embed"]
        assert "data" in str(leaf.sharding.spec) and "data" not in str(plain.params["embed"].sharding.spec)
        records = next(mixed.data)
        requests, completions, _, _ = mixed.rollout(records, 1)
        adv = np.linspace(-1, 1, len(requests)).astype(np.float32)
        tokens, pad, mask, adv, rollout_logp = mixed.build_batch(requests, completions, adv)
        place = lambda x: update.to_global(x[:8], update.rows_sharding(mixed.mesh, x[:8].shape, 0))  # noqa: E731
        recomputed = np.asarray(mixed._logp_fn(mixed.params, place(tokens), place(pad), place(mask))) * mask[:8]
        diff = np.abs(recomputed - rollout_logp[:8])[mask[:8] > 0]
        assert diff.max() < 0.1 and diff.mean() < 0.02, (diff.max(), diff.mean())
        assert diff.max() > 0  # the rollout really ran in bfloat16

        for t in (mixed, plain):
            t.train(tokens, pad, mask, adv)
            t.workers.update_weights(t.params)
        assert _dtypes(mixed.params) == _dtypes(mixed.opt_state) == {"float32"}
        for r in mixed.workers.replicas:
            assert _dtypes(r.engine.state) == {"bfloat16"}
        for a, b in zip(jax.tree.leaves(mixed.params), jax.tree.leaves(plain.params)):
            # up to summation order: an AdamW step moves a weight by ~lr (3e-3), a gradient of the wrong
            # sign by twice that
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)
        moved = mixed.workers.head_params["embed"]
        np.testing.assert_array_equal(np.asarray(moved), np.asarray(mixed.params["embed"]).astype(BF16))
    finally:
        mixed.close()
        plain.close()


def test_mixed_precision_grpo_with_adaptive_sd_and_online_drafter(tmp_path):
    """Two steps with bfloat16 engines, adaptive SD and online drafter training in the tail: the drafter
    trains (float32) and its bfloat16 copy reaches the engine. No plain arm: on a loaded machine the bandit
    chose plain decoding for the whole second rollout."""
    trainer = _trainer(
        tmp_path, "mesh.fsdp=-1", "model.rollout_dtype=bfloat16", "rollout.steps_per_call=2", "sd.mode=adaptive",
        "sd.plain_arm=false", "sd.threshold_live_batch=16", "sd.patience_host_steps=1", "sd.steps=2", "sd.topk=2",
        "sd.verify_tokens=4", "drafter_online.min_buffer_tokens=16", "drafter_online.batch_rows=8",
        "drafter_online.seq_len_tokens=32", "drafter_online.eval_rows=8", "drafter_online.tail_live_batch=16",
        "drafter_online.tail_time_share=0.9", "drafter_train.unroll_steps=1", steps=2)
    history = trainer.run()
    assert all(np.isfinite(h["loss"]) for h in history)
    assert history[-1]["sd_share"] > 0 and sum(h["drafter_steps"] for h in history) > 0
    assert _dtypes(nnx.state(trainer.spot.drafter(), nnx.Param)) == {"float32"}
    engine = trainer.workers.replicas[0].engine
    fc = trainer.spot.drafter().fc[...]
    np.testing.assert_array_equal(np.asarray(engine.drafter_state["fc"][...]), np.asarray(fc).astype(BF16))


def _unrolled_bfloat16_workers(tmp_path) -> tuple[RolloutWorkers, dict]:
    """Rollout workers with an unrolled bfloat16 engine over a float32 tiny policy, and the policy's parameters."""
    cfg = load_config(None, [*tiny_overrides(tmp_path), "model.rollout_dtype=bfloat16", "rollout.layer_loop=unrolled"])
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    model, _ = load_model(cfg.model.path, mesh, cfg.model.dtype)
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    return RolloutWorkers(cfg, graphdef, params, mesh, None), params


def test_unrolled_bfloat16_engines_keep_no_stacked_copy_of_the_layers(tmp_path):
    """Unrolled engines hold per-layer bfloat16 copies; the stacked bfloat16 cast a hand-off makes for them is
    dropped once they have theirs (only its embedding, norm and head stay, for the online drafter trainer)."""
    workers, params = _unrolled_bfloat16_workers(tmp_path)
    stacked = {(a.shape, jnp.dtype(BF16)) for a in jax.tree.leaves(params["layers"])}

    def stacked_copies():
        gc.collect()
        return [a for a in jax.live_arrays() if (a.shape, a.dtype) in stacked]

    assert not stacked_copies()
    workers.update_weights(jax.tree.map(lambda a: a * 1.5, params))
    assert not stacked_copies()
    assert workers.head_params["embed"].dtype == BF16 and jax.tree.leaves(workers.head_params["layers"])[0].shape[0] == 0


def test_a_hand_off_to_unrolled_engines_drops_their_old_layer_copies_before_cutting_new_ones(tmp_path, monkeypatch):
    """The layers live at most twice during a hand-off (the stacked cast and one set of per-layer copies), not
    three times (the old per-layer copies beside the new)."""
    workers, params = _unrolled_bfloat16_workers(tmp_path)
    old = [weakref.ref(a) for a in jax.tree.leaves(workers.replicas[0].engine.state["layers"])]
    alive = []

    def counted(state):
        gc.collect()
        alive.append(sum(r() is not None for r in old))
        return unstack_layers(state)

    monkeypatch.setattr(engine_module, "unstack_layers", counted)
    workers.update_weights(jax.tree.map(lambda a: a * 1.5, params))
    assert alive == [0]
    np.testing.assert_array_equal(np.asarray(workers.replicas[0].engine.state["layers"]["wq"].get_value()[1]),
                                  np.asarray(params["layers"]["wq"][1] * 1.5).astype(BF16))
