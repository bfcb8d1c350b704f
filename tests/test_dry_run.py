"""`train --dry-run`'s memory plan against what the engines and the trainer allocate (shapes only, no devices)."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from helpers.tiny_run import tiny_overrides

from fastrl_jax.config import load_config
from fastrl_jax.models.decoder import DTYPES, abstract_decoder
from fastrl_jax.rl import dry_run, update
from fastrl_jax.sharding import make_mesh, shardings_for

QWEN7B = Path(__file__).parent.parent / "configs" / "qwen2.5_7b_1node.yaml"
QWEN32B = QWEN7B.with_name("qwen2.5_32b_multinode.yaml")


def test_history_drafting_keeps_no_hidden_states_or_drafter_cache():
    # EAGLE strategies 8/4/48, 6/4/16, 5/4/8: the table keeps bfloat16 hidden states (features split over tensor=4)
    # and a one-layer drafter cache of 64 rows x 4 KV heads x 128 (one head on each device of tensor=4), whose slots
    # are the longest length bucket plus the 8/4/48 tree's 7 x 4 scratch
    eagle = dry_run.memory_plan(load_config(QWEN7B))
    assert eagle["hidden_states"] == 64 * 4096 * (3584 // 4) * 2
    assert eagle["drafter_kv_cache"] == 2 * 64 * 1 * (4096 + 28) * 128 * 2
    # History chains only (RolloutEngine: no drafter, so neither): the plan must not count 2.25 GiB the run never holds
    history = dry_run.memory_plan(load_config(QWEN7B, ["sd.strategies=['h8']", "sd.group_live_batch_ranges=[]"]))
    assert history["hidden_states"] == history["drafter_kv_cache"] == history["drafter"] == 0
    assert history["total"] == sum(history[k] for k in dry_run.MEMORY_PARTS)


def test_the_rollout_tables_rows_split_over_fsdp():
    # Qwen2.5-32B on fsdp=2 x tensor=4 replicas: each device holds 32 / 2 rows of 8 / 4 KV heads, 64 layers x 4096
    # slots x 128 in bfloat16 (RolloutEngine._placed); compaction's next table (16 rows) is whole on every device
    plan = dry_run.memory_plan(load_config(QWEN32B, ["model.path=qwen2.5-32b"]))
    assert plan["kv_cache"] == 2 * 64 * 16 * 2 * 4096 * 128 * 2
    assert plan["hidden_states"] == 16 * 4096 * (5120 // 4) * 2
    assert plan["compaction"] == plan["kv_cache"] + plan["hidden_states"] + plan["drafter_kv_cache"]


def test_train_logits_cover_the_completion_slots():
    # update.sequence_logprobs sends only the completion's C slots through the head, C = rl.max_new_tokens (3000)
    # rounded up to 3008, not the 4096-slot length bucket: 4 rows per device (8 over data x fsdp = 2), vocabulary
    # split over tensor = 4, logits, log-softmax and gradient in float32
    plan = dry_run.memory_plan(load_config(QWEN7B))
    assert plan["train_logits"] == 3 * 4 * 3008 * (152064 // 4) * 4


def test_train_activations_follow_the_layer_tensors():
    # Qwen2.5-7B on 8 devices (data 2, tensor 4): 4 rows per device of T = 1024 + 3008 slots, 28 / 4 heads,
    # 4 / 4 KV heads and 18944 / 4 MLP columns per device, float32. Per layer: 7 hidden-wide tensors, 2 query-
    # and 4 key/value-wide, 6 MLP-wide, and the reference's 2 float32 score tensors [rows, heads, T, T].
    rows, T, L, H = 4, 4032, 28, 3584
    lin = rows * T * (7 * H + (2 * 7 + 4 * 1) * 128 + 6 * 4736) * 4
    scores = 2 * rows * 7 * T * T * 4
    remat = dry_run.memory_plan(load_config(QWEN7B), platform="cpu")["train_activations"]  # rl.remat: true
    assert remat == L * rows * T * H * 4 + 2 * (lin + scores)  # layer inputs, one layer recomputed and its gradients
    # On a GPU the Triton forward keeps no scores; the backward builds one layer's
    assert dry_run.memory_plan(load_config(QWEN7B), platform="gpu")["train_activations"] == remat - scores
    kept = load_config(QWEN7B, ["rl.remat=false"])
    assert dry_run.memory_plan(kept, platform="cpu")["train_activations"] == (L + 1) * (lin + scores)
    assert dry_run.memory_plan(kept, platform="gpu")["train_activations"] == (L + 1) * lin + scores
    forced = load_config(QWEN7B, ["rl.remat=false", "model.attention=reference"])
    assert dry_run.memory_plan(forced, platform="gpu")["train_activations"] == (L + 1) * (lin + scores)


def test_a_run_whose_plan_exceeds_what_jax_may_allocate_is_warned_before_it_loads(monkeypatch):
    cfg = load_config(QWEN7B, ["model.attention=reference"])  # the same plan on every platform
    total = dry_run.memory_plan(cfg, 8)["total"]  # 54.8 GiB, 19.5 of them the update step's activations
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    warning = dry_run.memory_warning(cfg, 8, int(0.5 * 40 * 2**30))  # half of a 40 GiB card
    assert "needs 54.8 GiB a device" in warning and "JAX may allocate 20.0 GiB" in warning
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.5" in warning
    assert dry_run.memory_warning(cfg, 8, total) is None
    assert dry_run.memory_warning(cfg, 8, None) is None  # CPU: no device memory to plan against
    assert "needs a device of 109.6 GiB: JAX allocates at most 50%" in dry_run.plan(cfg, 8)


def _compiled_step(cfg, P: int, C: int):
    """The trainer's jitted update step on one device for one micro-batch of P + C slots, compiled from shapes:
    (its memory_analysis(), the batch's bytes)."""
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    graphdef, state = nnx.split(abstract_decoder(dry_run.model_config(cfg.model.path), DTYPES[cfg.model.dtype]))
    shardings = nnx.to_pure_dict(shardings_for(state, mesh, update.master_rules(cfg.model)))

    def place(tree, sh):
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh)

    params = place(nnx.to_pure_dict(state), shardings)
    tx = update.policy_optimizer(cfg.optim, 10)
    opt_shardings = update.optimizer_shardings(tx, params, shardings, mesh)
    opt_state = place(jax.eval_shape(tx.init, params), opt_shardings)
    M = cfg.rl.micro_batch_size
    i32, f32 = jnp.int32, jnp.float32
    batch = update.GRPOBatch(tokens=jax.ShapeDtypeStruct((1, M, P + C), i32), pad=jax.ShapeDtypeStruct((1, M), i32),
                             mask=jax.ShapeDtypeStruct((1, M, C), f32), advantages=jax.ShapeDtypeStruct((1, M), f32),
                             old_logp=jax.ShapeDtypeStruct((1, M, C), f32))
    step = update.jit_train_step(graphdef, tx, update.StepOptions.from_config(cfg.rl), shardings, opt_shardings, mesh,
                                 False, M)
    memory = step.lower(params, opt_state, None, batch).compile().memory_analysis()
    return memory, sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(batch))


def test_training_parts_cover_what_the_update_step_holds(tmp_path):
    # The trainer's jitted step on one device holds the parameters, the AdamW moments (donated: updated in place),
    # the batch, and returns new parameters beside the old; the plan must count all of them but the batch (the
    # gradients are among the step's temporaries).
    cfg = load_config(None, [*tiny_overrides(tmp_path), "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"])
    plan = dry_run.memory_plan(cfg)
    memory, batch_bytes = _compiled_step(cfg, 32, 32)
    # in: parameters, moments (donated) and the batch (less what the step never reads); out: the same moments,
    # the new parameters and the metrics
    assert 0 <= memory.argument_size_in_bytes - plan["params"] - plan["optimizer"] <= batch_bytes
    assert 0 <= memory.output_size_in_bytes - memory.alias_size_in_bytes - plan.get("new_params", 0) <= 1024


def test_training_plan_covers_the_update_steps_activations(tmp_path):
    # What the compiled step holds at its peak (its arguments, temporaries and outputs that are not donated
    # buffers) against the plan's training parts. The temporaries are mostly layer activations: each layer's
    # [rows, heads, T, T] attention scores without rl.remat (164 of 166 MiB for 64-token prompts; the plan's
    # training parts came to 5 MiB before it counted them). Measured plan / compiled on CPU: 0.97 and 0.93
    # without rl.remat, 1.58 and 1.43 with it (the plan counts the recomputed layer and its gradients whole).
    base = [*tiny_overrides(tmp_path), "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "rl.max_new_tokens=256",
            "rollout.length_buckets=[1024]"]
    training = ("params", "grads", "optimizer", "new_params", "reference", "train_logits", "train_activations")
    for remat in ("false", "true"):
        for prompt in (64, 256):
            cfg = load_config(None, [*base, f"rl.remat={remat}", f"rollout.prompt_buckets=[{prompt}]"])
            plan = sum(dry_run.memory_plan(cfg)[k] for k in training)
            memory, _ = _compiled_step(cfg, prompt, 256)
            compiled = (memory.argument_size_in_bytes + memory.temp_size_in_bytes + memory.output_size_in_bytes
                        - memory.alias_size_in_bytes)
            assert 0.6 <= plan / compiled <= 2.0, (remat, prompt, plan / 2**20, compiled / 2**20)


def test_the_known_model_table_matches_whole_names():
    """'.../Qwen2.5-7B-Instruct-1M' holds 'qwen2.5-7b' and was planned with its RoPE and context (review)."""
    from fastrl_jax.models.known_configs import KNOWN, known_config

    assert known_config("/checkpoints/Qwen2.5-7B-Instruct") is KNOWN["qwen2.5-7b"]
    assert known_config("Qwen/Qwen2.5-32B") is KNOWN["qwen2.5-32b"] and known_config("smollm2") is KNOWN["smollm2-135m"]
    assert known_config("/checkpoints/Qwen2.5-7B-Instruct-1M") is None
