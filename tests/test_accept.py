"""Tree accept: greedy golden cases, coupled == plain sampling bit for bit, rejection exactness
(chi-square against the exact sequence distribution, and a biased variant that the same test
rejects), and the Pallas walk against the reference walk."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fastrl_jax.kernels.tree_accept import api as tree_accept
from fastrl_jax.kernels.tree_accept import pallas as walk_pallas
from helpers.sampling_reference import filtered_probs
from scipy.stats import chisquare

from fastrl_jax.rollout import accept
from fastrl_jax.rollout.accept import accept_coupled, accept_greedy, accept_rejection
from fastrl_jax.rollout.sampling import SamplingParams, sample


def params_for(B, temperature=1.0, top_k=0, top_p=1.0, seed0=0):
    def full(value, dtype):
        return jnp.broadcast_to(jnp.asarray(value, dtype), (B,))

    return SamplingParams(
        temperature=full(temperature, jnp.float32),
        top_k=full(top_k, jnp.int32),
        top_p=full(top_p, jnp.float32),
        seed=jnp.arange(B, dtype=jnp.uint32) + jnp.uint32(seed0),
    )


def assert_accepted_equal(a, b):
    for name in ("path", "n_accepted", "tokens", "n_tokens", "logprobs"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def numpy_walk(y, tokens, parents, valid):
    """The walk written as plainly as possible, one row at a time."""
    B, N = y.shape
    path = np.full((B, N), -1)
    for b in range(B):
        cur, path[b, 0], i = 0, 0, 1
        while True:
            children = [c for c in range(N) if parents[b, c] == cur and valid[b, c] and tokens[b, c] == y[b, cur]]
            if not children:
                break
            cur = path[b, i] = children[0]
            i += 1
    return path, (path >= 0).sum(1) - 1


def random_trees(rng, B, N, V, match=0.6, p_valid=0.85):
    """Random trees whose tokens often equal the target y of their parent, so walks go deep."""
    y = rng.integers(0, V, (B, N))
    parents = np.full((B, N), -1)
    tokens = rng.integers(0, V, (B, N))
    for c in range(1, N):
        parents[:, c] = rng.integers(0, c, B)
        tokens[:, c] = np.where(rng.random(B) < match, y[np.arange(B), parents[:, c]], tokens[:, c])
    valid = rng.random((B, N)) < p_valid
    valid[:, 0] = True
    return y, tokens, parents, valid


# --- greedy golden cases ---------------------------------------------------------------------

# Root (token 1) -> 1 (token 2), 2 (token 3); 2 -> 3 (token 4), 4 (token 5); 4 -> 5 (token 6);
# 1 -> 6 (token 7).
GOLDEN_PARENTS = [-1, 0, 0, 2, 2, 4, 1]
GOLDEN_TOKENS = [1, 2, 3, 4, 5, 6, 7]


def logits_with_argmax(argmax, V=8, seed=0):
    """Random logits [B, N, V] whose argmax after each node is the given one."""
    argmax = np.asarray(argmax)
    base = np.random.default_rng(seed).normal(size=argmax.shape + (V,)).astype(np.float32)
    np.put_along_axis(base, argmax[..., None], base.max(-1, keepdims=True) + 1.0, axis=-1)
    return jnp.asarray(base)


def run_greedy(parents, tokens, valid, argmax):
    logits = logits_with_argmax(argmax)
    out = accept_greedy(jnp.asarray(tokens), jnp.asarray(parents), jnp.asarray(valid), logits)
    return out, jax.nn.log_softmax(logits, axis=-1)


def test_greedy_follows_second_branch_two_levels_deep():
    # argmax after root = 3 (node 2), after node 2 = 5 (node 4), after node 4 = 0 (no child).
    argmax = [[3, 2, 5, 0, 0, 6, 0]]
    out, logp = run_greedy([GOLDEN_PARENTS], [GOLDEN_TOKENS], np.ones((1, 7), bool), argmax)
    np.testing.assert_array_equal(out.path, [[0, 2, 4, -1, -1, -1, -1]])
    np.testing.assert_array_equal(out.tokens, [[3, 5, 0, -1, -1, -1, -1]])
    assert int(out.n_accepted[0]) == 2 and int(out.n_tokens[0]) == 3
    expected = [logp[0, 0, 3], logp[0, 2, 5], logp[0, 4, 0], 0, 0, 0, 0]
    np.testing.assert_array_equal(out.logprobs, [expected])


def test_greedy_without_a_matching_child_emits_only_the_bonus():
    # 7 is node 6's token, but node 6 is a grandchild of the root, not a child.
    out, logp = run_greedy([GOLDEN_PARENTS], [GOLDEN_TOKENS], np.ones((1, 7), bool), [[7, 2, 5, 0, 0, 0, 0]])
    np.testing.assert_array_equal(out.path, [[0, -1, -1, -1, -1, -1, -1]])
    np.testing.assert_array_equal(out.tokens, [[7, -1, -1, -1, -1, -1, -1]])
    assert int(out.n_accepted[0]) == 0 and int(out.n_tokens[0]) == 1
    np.testing.assert_array_equal(out.logprobs, [[logp[0, 0, 7], 0, 0, 0, 0, 0, 0]])


def test_greedy_skips_invalid_nodes():
    # Row 0: the only child with the argmax token (node 1) is padding -> bonus only.
    # Row 1: node 1 (padding) and node 2 (valid) both carry the argmax token -> node 2.
    parents = [GOLDEN_PARENTS, GOLDEN_PARENTS]
    tokens = [GOLDEN_TOKENS, [1, 3, 3, 4, 5, 6, 7]]
    valid = np.ones((2, 7), bool)
    valid[:, 1] = False
    out, _ = run_greedy(parents, tokens, valid, [[2, 0, 0, 0, 0, 0, 0], [3, 4, 4, 0, 0, 0, 0]])
    np.testing.assert_array_equal(out.path, [[0, -1, -1, -1, -1, -1, -1], [0, 2, 3, -1, -1, -1, -1]])
    np.testing.assert_array_equal(out.tokens, [[2, -1, -1, -1, -1, -1, -1], [3, 4, 0, -1, -1, -1, -1]])


# --- coupled sampling: bit-identical to plain sampling ---------------------------------------


def test_coupled_emits_exactly_what_plain_sampling_emits():
    B, N, V = 48, 12, 16
    rng = np.random.default_rng(0)
    table = jax.random.normal(jax.random.key(0), (V, V)) * 2.0
    params = SamplingParams(
        temperature=jnp.asarray(np.resize([0.0, 0.6, 1.0, 1.4], B), jnp.float32),
        top_k=jnp.asarray(np.resize([0, 0, 4], B), jnp.int32),
        top_p=jnp.asarray(np.resize([1.0, 0.9], B), jnp.float32),
        seed=jnp.asarray(rng.integers(0, 2**32, B), jnp.uint32),
    )
    root_pos = rng.integers(3, 40, B)
    sample_jit = jax.jit(sample)
    rows = np.arange(B)

    # Build each tree along the policy's own samples: a node's child often carries the token the
    # policy samples after it (y), sometimes a random one; some nodes are padding.
    parents, tokens, depth, y = (np.zeros((B, N), int) for _ in range(4))
    parents[:, 0] = -1
    tokens[:, 0] = rng.integers(0, V, B)
    valid = rng.random((B, N)) < 0.9
    valid[:, 0] = True
    for c in range(N):
        if c:
            parents[:, c] = rng.integers(0, c, B)
            depth[:, c] = depth[rows, parents[:, c]] + 1
            on_policy = rng.random(B) < 0.75
            tokens[:, c] = np.where(on_policy, y[rows, parents[:, c]], rng.integers(0, V, B))
        y[:, c] = sample_jit(table[tokens[:, c]], params, jnp.asarray(root_pos + depth[:, c] + 1))[0]

    tokens_j = jnp.asarray(tokens, jnp.int32)
    out = jax.jit(accept_coupled)(
        tokens_j, jnp.asarray(parents, jnp.int32), jnp.asarray(valid), table[tokens_j], params, jnp.asarray(root_pos)
    )

    plain_tokens, plain_logprobs, last = [], [], jnp.asarray(tokens[:, 0])
    for i in range(N):
        last, logprob = sample_jit(table[last], params, jnp.asarray(root_pos + 1 + i))
        plain_tokens.append(last)
        plain_logprobs.append(logprob)
    plain_tokens, plain_logprobs = np.stack(plain_tokens, 1), np.stack(plain_logprobs, 1)

    n = np.asarray(out.n_tokens)
    emitted = np.arange(N)[None] < n[:, None]
    np.testing.assert_array_equal(np.asarray(out.tokens), np.where(emitted, plain_tokens, -1))
    # Log-probs agree to rounding only: XLA may order the softmax sum differently in two programs.
    np.testing.assert_allclose(np.asarray(out.logprobs), np.where(emitted, plain_logprobs, 0.0), rtol=1e-5, atol=1e-6)
    assert n.mean() > 2.5 and n.max() >= 5  # the trees were accepted deep, not just the bonus


def test_temperature_zero_reduces_to_greedy():
    B, N, V = 32, 10, 12
    y, tokens, parents, valid = random_trees(np.random.default_rng(1), B, N, V)
    logits = jnp.asarray(logits_with_argmax(y, V, seed=2))
    args = (jnp.asarray(tokens, jnp.int32), jnp.asarray(parents, jnp.int32), jnp.asarray(valid), logits)
    greedy = jax.jit(accept_greedy)(*args)
    assert int(greedy.n_accepted.max()) >= 3
    root_pos = jnp.arange(B, dtype=jnp.int32)
    coupled, rejection = jax.jit(accept_coupled), jax.jit(accept_rejection)
    for top_k, top_p in ((0, 1.0), (3, 0.5)):
        params = params_for(B, temperature=0.0, top_k=top_k, top_p=top_p)
        assert_accepted_equal(coupled(*args, params, root_pos), greedy)
        assert_accepted_equal(rejection(*args, params, root_pos), greedy)


# --- rejection sampling: exact in distribution ------------------------------------------------

V_TOY = 8
POLICY = jax.random.normal(jax.random.key(10), (V_TOY, V_TOY)) * 1.5  # next-token logits after a token
# A different, worse model that still agrees with the policy often enough to exercise acceptance.
DRAFTER = POLICY + jax.random.normal(jax.random.key(11), (V_TOY, V_TOY)) * 1.5
ROOT_TOKEN, ROOT_POS, N_SEEDS, N_EMITTED = 3, 7, 24_000, 3


def topk_tree(k, depth):
    """Static draft-tree spec [(parent, rank)]: node c drafts the rank-th most likely drafter token
    after its parent's token; rank -1 is a padding node carrying the policy's argmax token."""
    spec, level = [(-1, 0)], [0]
    for _ in range(depth):
        level_next = []
        for parent in level:
            for rank in range(k):
                spec.append((parent, rank))
                level_next.append(len(spec) - 1)
        level = level_next
    return spec


TREES = {
    "topk2_depth2_padded": topk_tree(2, 2) + [(0, -1)],
    "topk2_depth3": topk_tree(2, 3),
    # The drafter's top token after ROOT_TOKEN is outside the policy's top-p set, so the chain
    # starts from its second choice: the test needs drafts that can be accepted.
    "chain3": [(-1, 0), (0, 1), (1, 0), (2, 0)],
    "repeated_siblings": [(-1, 0), (0, 0), (0, 0), (0, 1), (1, 0), (2, 0), (3, 0)],
}


def build_tree(spec, root, policy, drafter):
    """root [B] -> tokens [B, N], parents [B, N], valid [B, N] of a deterministic draft tree."""
    tokens = [root]
    for parent, rank in spec[1:]:
        after = tokens[parent]
        if rank < 0:
            tokens.append(jnp.argmax(policy[after], -1).astype(jnp.int32))
        else:
            tokens.append(jnp.argsort(-drafter[after], axis=-1)[:, rank].astype(jnp.int32))
    B = root.shape[0]
    parents = jnp.broadcast_to(jnp.asarray([p for p, _ in spec], jnp.int32), (B, len(spec)))
    valid = jnp.broadcast_to(jnp.asarray([r >= 0 for _, r in spec]), (B, len(spec)))
    return jnp.stack(tokens, 1), parents, valid


def first_tokens(spec, params, root, root_pos, policy, drafter):
    """[B, N_EMITTED] first tokens after root [B] (at root_pos [B]), by repeated accept steps
    from the new root, and the mean number of drafts accepted by the first step. Every input is
    an argument: constants would make XLA fold the whole first step at compile time."""
    B, N = params.seed.shape[0], len(spec)
    rows = jnp.arange(B)
    out = jnp.full((B, N_EMITTED), -1, jnp.int32)
    count = jnp.zeros(B, jnp.int32)
    last, pos = root, root_pos
    for step in range(N_EMITTED):
        tokens, parents, valid = build_tree(spec, last, policy, drafter)
        acc = accept_rejection(tokens, parents, valid, policy[tokens], params, pos)
        slot = jnp.where(jnp.arange(N)[None] < acc.n_tokens[:, None], count[:, None] + jnp.arange(N)[None], N_EMITTED)
        out = out.at[rows[:, None], slot].set(acc.tokens, mode="drop")
        if step == 0:
            mean_accepted = jnp.mean(acc.n_accepted.astype(jnp.float32))
        count += acc.n_tokens
        last = acc.tokens[rows, acc.n_tokens - 1]
        pos += acc.n_tokens
    return out, mean_accepted


def exact_sequence_probs(params_one):
    """P(t1, t2, t3 | ROOT_TOKEN) [V**3] of plain token-by-token sampling from POLICY, by numpy's HF-order filters
    (not sampling.filtered_logits: a filter that applied temperature after top-p passed against itself, review)."""
    t, k, tp = float(params_one.temperature[0]), int(params_one.top_k[0]), float(params_one.top_p[0])
    p = np.stack([filtered_probs(row, t, k, tp) for row in np.asarray(POLICY)])  # p[x] = P(.|x)
    joint = p[ROOT_TOKEN][:, None, None] * p[:, :, None] * p[None, :, :]
    return joint.reshape(-1)


def chi_square(samples, probs):
    """Chi-square of the observed sequences against probs, pooling cells expected below 5.
    Sequences of probability 0 must never appear."""
    cells = np.asarray(samples) @ np.array([V_TOY**2, V_TOY, 1])
    counts = np.bincount(cells, minlength=V_TOY**N_EMITTED).astype(np.float64)
    expected = probs / probs.sum() * len(cells)
    impossible = expected == 0
    small = ~impossible & (expected < 5)
    big = ~impossible & ~small
    f_obs, f_exp = counts[big], expected[big]
    if small.any():
        f_obs, f_exp = np.append(f_obs, counts[small].sum()), np.append(f_exp, expected[small].sum())
    stat, pvalue = chisquare(f_obs, f_exp)
    return stat, pvalue, int(counts[impossible].sum()), len(f_obs) - 1


SETTINGS = [
    ("topk2_depth2_padded", dict(temperature=1.0)),
    ("topk2_depth3", dict(temperature=0.7, top_k=5, top_p=0.9)),
    ("chain3", dict(temperature=1.3, top_p=0.85)),
    ("repeated_siblings", dict(temperature=1.0, top_k=6)),
]


def run_first_tokens(tree, settings):
    params = params_for(N_SEEDS, **settings)
    run = jax.jit(functools.partial(first_tokens, TREES[tree]))
    root = jnp.full(N_SEEDS, ROOT_TOKEN, jnp.int32)
    samples, mean_accepted = run(params, root, jnp.full(N_SEEDS, ROOT_POS, jnp.int32), POLICY, DRAFTER)
    return samples, float(mean_accepted), exact_sequence_probs(params)


@pytest.mark.parametrize("tree,settings", SETTINGS, ids=[t for t, _ in SETTINGS])
def test_rejection_sampling_is_exact(tree, settings):
    samples, mean_accepted, probs = run_first_tokens(tree, settings)
    stat, pvalue, impossible, dof = chi_square(samples, probs)
    print(f"{tree} {settings}: chi2={stat:.1f} dof={dof} p={pvalue:.3g} mean accepted={mean_accepted:.2f}")
    assert impossible == 0
    assert mean_accepted > 0.3  # drafts are accepted, so the rejection path is what is tested
    assert pvalue > 1e-3


def test_rejection_sampling_is_exact_with_mixed_rows():
    """Greedy rows and rows of other temperatures, top-k and top-p share one batch: each row's tokens
    follow its own parameters (greedy rows: exactly the argmax chain)."""
    groups = [dict(temperature=0.0), SETTINGS[1][1], SETTINGS[2][1]]
    per_group = [params_for(N_SEEDS, **g, seed0=k * N_SEEDS) for k, g in enumerate(groups)]
    params = jax.tree.map(lambda *a: jnp.stack(a, 1).reshape(-1), *per_group)  # rows cycle through the groups
    B = len(groups) * N_SEEDS
    run = jax.jit(functools.partial(first_tokens, TREES["topk2_depth3"]))
    samples, _ = run(params, jnp.full(B, ROOT_TOKEN, jnp.int32), jnp.full(B, ROOT_POS, jnp.int32), POLICY, DRAFTER)
    samples = np.asarray(samples).reshape(N_SEEDS, len(groups), N_EMITTED)
    greedy = [ROOT_TOKEN]
    for _ in range(N_EMITTED):
        greedy.append(int(jnp.argmax(POLICY[greedy[-1]])))
    assert (samples[:, 0] == greedy[1:]).all()
    for k in (1, 2):
        stat, pvalue, impossible, dof = chi_square(samples[:, k], exact_sequence_probs(per_group[k]))
        print(f"{groups[k]}: chi2={stat:.1f} dof={dof} p={pvalue:.3g}")
        assert impossible == 0 and pvalue > 1e-3


EXACT_ACCEPT_PROB = accept._child_accept_prob


def biased_double(q, mass_before, repeat):
    return jnp.minimum(1.0, 2.0 * EXACT_ACCEPT_PROB(q, mass_before, repeat))


def biased_no_renormalisation(q, mass_before, repeat):
    return jnp.where(repeat, 0.0, q)


@pytest.mark.parametrize("bias", [biased_double, biased_no_renormalisation], ids=["double", "no_renorm"])
def test_chi_square_rejects_a_biased_acceptance_rule(bias, monkeypatch):
    """The same test fails when the acceptance rule is wrong: accept_rejection is retraced with
    a biased child-acceptance probability."""
    tree, settings = SETTINGS[1]
    monkeypatch.setattr(accept, "_child_accept_prob", bias)
    samples, _, probs = run_first_tokens(tree, settings)
    stat, pvalue, impossible, dof = chi_square(samples, probs)
    print(f"biased {bias.__name__} {tree}: chi2={stat:.1f} dof={dof} p={pvalue:.3g}")
    assert pvalue < 1e-3


def test_rejection_keys_are_positional():
    """Same seed and positions -> same result whatever the row; a different seed changes it."""
    B, N, V = 16, 9, 12
    y, tokens, parents, valid = random_trees(np.random.default_rng(3), B, N, V)
    logits = jax.random.normal(jax.random.key(4), (B, N, V)) * 2.0
    args = (jnp.asarray(tokens, jnp.int32), jnp.asarray(parents, jnp.int32), jnp.asarray(valid), logits)
    params = params_for(B, temperature=1.0, seed0=5)
    root_pos = jnp.arange(B, dtype=jnp.int32) + 10
    rejection = jax.jit(accept_rejection)
    out = rejection(*args, params, root_pos)
    perm = np.random.default_rng(6).permutation(B)
    permuted = rejection(*jax.tree.map(lambda a: a[perm], (*args, params, root_pos)))
    assert_accepted_equal(permuted, jax.tree.map(lambda a: a[perm], out))
    other = rejection(*args, params.replace(seed=params.seed + 1000), root_pos)
    assert not np.array_equal(np.asarray(other.tokens), np.asarray(out.tokens))


# --- Pallas walk ------------------------------------------------------------------------------


@pytest.mark.parametrize("B,N,block_rows", [(13, 10, 4), (5, 7, 8), (16, 33, 8)])
def test_pallas_walk_matches_reference(B, N, block_rows):
    y, tokens, parents, valid = random_trees(np.random.default_rng(B * N), B, N, V=6, match=0.7)
    y, tokens, parents, valid = (jnp.asarray(a) for a in (y, tokens, parents, valid))
    acceptable = tree_accept.acceptable_children(y, tokens, parents, valid)
    (ref_path, ref_n), used = tree_accept.walk(acceptable, parents, backend="reference", with_backend=True)
    assert used == "reference"
    # the compiled kernel where there is a GPU or TPU, else the interpreter (with the GPU's padding)
    path, n = walk_pallas.walk(acceptable, parents, block_rows=block_rows, interpret=jax.default_backend() == "cpu")
    np.testing.assert_array_equal(path, ref_path)
    np.testing.assert_array_equal(n, ref_n)
    np_path, np_n = numpy_walk(y, tokens, parents, valid)
    np.testing.assert_array_equal(ref_path, np_path)
    np.testing.assert_array_equal(ref_n, np_n)
    assert np_n.max() >= 3


@pytest.mark.parametrize("target", ["cuda", "tpu"])
@pytest.mark.parametrize("B,N", [(16, 8), (5, 48), (13, 7), (64, 17)])
def test_pallas_walk_lowers_for_gpu_and_tpu(target, B, N):
    """Cross-lowered from this CPU: through Triton on a GPU (without Triton's compiler parameters Pallas
    took the Mosaic GPU lowering, which rejected the kernel, and Triton takes power-of-two blocks only,
    so verify_tokens 7 or 48 are padded) and through Mosaic on a TPU."""
    args = [jax.ShapeDtypeStruct((B, N), jnp.bool_), jax.ShapeDtypeStruct((B, N), jnp.int32)]
    fn = lambda a, p: walk_pallas.walk(a, p, platform={"cuda": "gpu", "tpu": "tpu"}[target])  # noqa: E731
    hlo = jax.jit(fn).trace(*args).lower(lowering_platforms=(target,)).as_text()
    assert {"cuda": "custom_call @__gpu$xla.gpu.triton", "tpu": "custom_call @tpu_custom_call"}[target] in hlo
