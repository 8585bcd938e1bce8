"""MuonLP: optimizer-state bytes, step time and final loss per ``state_dtype``, against fp32 Muon.

Two short training tasks, each run once with ``MuonForeach`` (fp32 momentum) and once per
``MuonLP`` state dtype, from the same initialization and data:

- ``mlp``: a small residual MLP, teacher-student regression on fresh synthetic batches (MSE on
  a fixed held-out set). Its loss is driven towards zero and is still falling steeply at the end,
  so it is very sensitive: a run that is a few steps behind shows a large relative difference
  (i.i.d. noise of 3% of the block RMS injected into fp32 momentum each step already costs
  about +2% here).
- ``lm``: a tiny byte-level causal transformer language model on the Python standard library's
  own source files (local, no network; held-out cross-entropy on other files).

It prints, per state dtype: bytes of Muon optimizer state per Muon parameter element (codes +
scales; fp32 is 4.0), the median ``optimizer.step()`` time of the ``mlp`` task and its ratio
to fp32-state ``MuonForeach``, and each task's final held-out loss and its relative difference
to the fp32-state run. A second fp32 run with another data seed (row ``fp32 seed+1``) shows
the run-to-run noise the 2% tolerance is measured against. ``--seeds N`` runs every row on N
data seeds (0..N-1; ``fp32 seed+1``: N..2N-1) and compares mean final losses, which makes the
2% comparison less noisy. ``--dtypes`` picks the state dtypes; ``int4/64`` is int4 with
``block_size=64`` (the default is the dtype's default block size).

Uses CUDA when available. ``--quick`` is a shorter, smaller run (the CPU default).
``--results PATH`` writes the table into its own marked section of a markdown file
(e.g. RESULTS.md), replacing an earlier run's (GPU and CPU runs have separate sections).

    python scripts/bench_lp.py                 # GPU: a few hundred steps
    python scripts/bench_lp.py --quick         # CPU: well under 3 minutes on 2 cores
    python scripts/bench_lp.py --compile --results RESULTS.md   # adds compile time
    python scripts/bench_lp.py --quick --dtypes int4,int4/64 --seeds 3 --tasks mlp
    python scripts/bench_lp.py --tasks mlp --mlp-dim 256 --mlp-hidden 1024 --mlp-depth 6 \\
        --mlp-batch 512 --steps 400 --seeds 2   # CPU proxy of the H200 mlp run (~25 min)

``--mlp-dim``, ``--mlp-hidden``, ``--mlp-depth``, ``--mlp-batch``, ``--mlp-d-in`` override the
preset's ``mlp`` sizes (``--mlp-d-in`` sets the input and output width).

Eager ``MuonLP`` requantizes with torchao's ops one parameter at a time (tens of small
kernels each); ``--compile`` (``compile=True``) fuses them, which is how to use it for speed.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import platform
import shlex
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for results_md
from results_md import write_section  # noqa: E402
from torch import nn

from muon_plugin import MuonForeach, MuonLP

TARGET_BYTES = {"int8": 1.1, "int4": 0.6, "fp8": 1.1, "bf16": 2.0}
TARGET_LOSS = 0.02


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))).square())


class Net(nn.Module):
    def __init__(self, d_in: int, dim: int, hidden: int, depth: int, d_out: int) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class LMBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    """Byte-level causal transformer (learned positions, pre-norm blocks)."""

    def __init__(self, dim: int, depth: int, heads: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(seq, dim))
        self.blocks = nn.ModuleList(LMBlock(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 256, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def stdlib_text(max_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) bytes of the standard library's ``.py`` files; every 10th file is held
    out. Deterministic for a given Python installation; no network."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in root.glob("*.py") if f.is_file())
    if len(files) < 20:
        raise RuntimeError(f"too few Python source files under {root} for the lm task")
    train, held = bytearray(), bytearray()
    for i, f in enumerate(files):
        dst = held if i % 10 == 0 else train
        if len(dst) < max_bytes:
            dst += f.read_bytes()
    to_tensor = lambda b: torch.frombuffer(bytearray(b[:max_bytes]), dtype=torch.uint8).long()  # noqa: E731
    return to_tensor(train), to_tensor(held)


def param_groups(model: nn.Module) -> list[dict]:
    """Muon for the block matrices; AdamW for input/output layers, norms and biases."""
    muon = [p for n, p in model.named_parameters() if n.startswith("blocks") and p.ndim == 2]
    ids = {id(p) for p in muon}
    adam = [p for p in model.parameters() if id(p) not in ids]
    return [{"params": muon}, {"params": adam, "algorithm": "adamw", "lr": 3e-3}]


def make_optimizer(model: nn.Module, state_dtype: str, args) -> torch.optim.Optimizer:
    """``state_dtype``: "fp32" (``MuonForeach``), or a MuonLP state dtype, optionally with a
    block size after a slash ("int4/64")."""
    kwargs = dict(lr=args.lr, wd=0.01, compile=args.compile)
    if state_dtype == "fp32":
        return MuonForeach(param_groups(model), **kwargs)
    kind, _, block = state_dtype.partition("/")
    block_size = int(block) if block else None
    return MuonLP(param_groups(model), state_dtype=kind, block_size=block_size, **kwargs)


def state_bytes_per_param(opt: torch.optim.Optimizer) -> float:
    if isinstance(opt, MuonLP):
        nbytes, numel = opt.state_bytes()
        return nbytes / numel
    muon = [p for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]]
    nbytes = sum(
        opt.state[p]["momentum_buffer"].numel() * opt.state[p]["momentum_buffer"].element_size()
        for p in muon
    )
    return nbytes / sum(p.numel() for p in muon)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_step(opt: torch.optim.Optimizer, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    opt.step()
    sync(device)
    return time.perf_counter() - t0


def schedule(opt: torch.optim.Optimizer, args) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * max(0.1, 1 - s / args.steps)
    )


def run_mlp(state_dtype: str, teacher: Net, args, device: torch.device, seed: int = 0) -> dict:
    torch.manual_seed(1)
    model = Net(args.d_in, args.dim, args.hidden, args.depth, args.d_out).to(device)
    opt = make_optimizer(model, state_dtype, args)
    sched = schedule(opt, args)
    data = torch.Generator(device=device).manual_seed(1234 + seed)
    eval_gen = torch.Generator(device=device).manual_seed(999)
    x_eval = torch.randn(args.eval_batch, args.d_in, device=device, generator=eval_gen)
    with torch.no_grad():
        y_eval = teacher(x_eval)
    times = []
    for _ in range(args.steps):
        x = torch.randn(args.batch, args.d_in, device=device, generator=data)
        with torch.no_grad():
            y = teacher(x)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        times.append(timed_step(opt, device))
        sched.step()
    with torch.no_grad():
        final = nn.functional.mse_loss(model(x_eval), y_eval).item()
    skip = min(5, len(times) - 1)  # first steps: state allocation, compilation
    return {
        "bytes": state_bytes_per_param(opt),
        "step_ms": 1e3 * statistics.median(times[skip:]),
        "loss": final,
    }


def run_lm(state_dtype: str, text: tuple, args, device: torch.device, seed: int = 0) -> dict:
    train, held = (t.to(device) for t in text)
    torch.manual_seed(1)
    model = TinyLM(args.lm_dim, args.lm_depth, args.lm_heads, args.lm_seq).to(device)
    opt = make_optimizer(model, state_dtype, args)
    sched = schedule(opt, args)
    data = torch.Generator(device=device).manual_seed(4321 + seed)
    span = torch.arange(args.lm_seq + 1, device=device)
    n_eval = (held.numel() - 1) // (args.lm_seq + 1)
    eval_idx = held[: n_eval * (args.lm_seq + 1)].view(n_eval, -1)[: args.lm_eval_batch]

    def lm_loss(batch: torch.Tensor) -> torch.Tensor:
        logits = model(batch[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))

    for _ in range(args.steps):
        starts = torch.randint(
            0, train.numel() - args.lm_seq - 1, (args.lm_batch, 1), device=device, generator=data
        )
        loss = lm_loss(train[starts + span])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    with torch.no_grad():
        final = lm_loss(eval_idx).item()
    return {"bytes": state_bytes_per_param(opt), "loss": final}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def parse_args() -> argparse.Namespace:
    """The command line, checked (``--tasks``, ``--seeds``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short small run (CPU default)")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--compile", action="store_true", help="MuonForeach/MuonLP compile=True")
    parser.add_argument(
        "--dtypes", default="bf16,int8,int4,fp8", help="comma-separated MuonLP state dtypes"
    )
    parser.add_argument("--tasks", default="mlp,lm", help="comma-separated: mlp, lm")
    parser.add_argument(
        "--seeds", type=int, default=1, help="data seeds per row; final losses are averaged"
    )
    parser.add_argument("--lr", type=float, default=0.02)
    for opt, what in [
        ("dim", "width"),
        ("hidden", "hidden width"),
        ("depth", "number of blocks"),
        ("batch", "batch size"),
        ("d-in", "input and output width"),
    ]:
        parser.add_argument(
            f"--mlp-{opt}", type=int, default=None, help=f"mlp task: {what} (default: preset)"
        )
    parser.add_argument(
        "--results", default=None, help="write the MuonLP section of this markdown file"
    )
    args = parser.parse_args()
    args.task_list = args.tasks.split(",")
    if not args.task_list or any(t not in ("mlp", "lm") for t in args.task_list):
        parser.error(f"--tasks: expected a comma-separated subset of mlp,lm, got {args.tasks!r}")
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    return args


def apply_preset(args: argparse.Namespace, device: torch.device) -> None:
    """Fill in the sizes: the quick preset (``--quick`` or a CPU) or the full one, then the
    ``--mlp-*`` overrides."""
    if args.quick or device.type == "cpu":
        args.d_in, args.dim, args.hidden, args.depth, args.d_out = 64, 256, 1024, 2, 64
        args.batch, args.eval_batch = 256, 2048
        args.lm_dim, args.lm_depth, args.lm_heads, args.lm_seq = 128, 2, 4, 64
        args.lm_batch, args.lm_eval_batch, args.lm_bytes = 16, 128, 1_000_000
        args.steps = args.steps or 120
    else:
        args.d_in, args.dim, args.hidden, args.depth, args.d_out = 256, 1024, 4096, 6, 256
        args.batch, args.eval_batch = 1024, 8192
        args.lm_dim, args.lm_depth, args.lm_heads, args.lm_seq = 512, 4, 8, 256
        args.lm_batch, args.lm_eval_batch, args.lm_bytes = 64, 256, 8_000_000
        args.steps = args.steps or 400
    for name in ("dim", "hidden", "depth", "batch"):
        if getattr(args, f"mlp_{name}") is not None:
            setattr(args, name, getattr(args, f"mlp_{name}"))
    if args.mlp_d_in is not None:
        args.d_in = args.d_out = args.mlp_d_in
    args.warmup = max(1, args.steps // 20)


def setup_lines(args: argparse.Namespace, text: tuple | None) -> list[str]:
    """What each task trains, for the printout and the RESULTS.md section."""
    setup = []
    if "mlp" in args.task_list:
        setup.append(
            f"mlp: dim {args.dim} hidden {args.hidden} depth {args.depth} "
            f"({2 * args.depth} Muon matrices), batch {args.batch}, MSE"
        )
    if "lm" in args.task_list:
        setup.append(
            f"lm: byte-level transformer dim {args.lm_dim} depth {args.lm_depth} "
            f"({4 * args.lm_depth} Muon matrices), seq {args.lm_seq}, batch {args.lm_batch}, "
            f"stdlib .py text ({text[0].numel() // 1000} kB train, "
            f"{text[1].numel() // 1000} kB held out), cross-entropy"
        )
    seeds_note = f", final loss: mean of {args.seeds} data seeds" if args.seeds > 1 else ""
    setup.append(f"{args.steps} steps each, compile={args.compile}{seeds_note}")
    return setup


def run_rows(args: argparse.Namespace, runs: dict) -> list[dict]:
    """One row per state dtype (fp32 twice: its data seeds and the next ones, for noise)."""
    tasks, n = args.task_list, args.seeds
    rows = []
    for name, state_dtype, first_seed in [
        ("fp32", "fp32", 0),
        ("fp32 seed+1" if n == 1 else f"fp32 seeds {n}-{2 * n - 1}", "fp32", n),
        *((d, d, 0) for d in args.dtypes.split(",")),
    ]:
        row = {"name": name, "state_dtype": state_dtype.partition("/")[0]}
        for task in tasks:
            results = [runs[task](state_dtype, first_seed + i) for i in range(n)]
            row.setdefault("bytes", results[0]["bytes"])
            if task == "mlp":
                row["step_ms"] = statistics.median(r["step_ms"] for r in results)
            row[task] = statistics.fmean(r["loss"] for r in results)
        rows.append(row)
        losses = ", ".join(f"{t} loss {row[t]:.5f}" for t in tasks)
        print(f"  {name}: {row['bytes']:.3f} B/param, {losses}", flush=True)
    return rows


def table_row(r: dict, base: dict, tasks: list[str]) -> str:
    """One markdown row: bytes against the target, mlp step time, each task's loss verdict."""
    target = TARGET_BYTES.get(r["state_dtype"])
    ok_bytes = ""
    if target is not None:
        ok_bytes = f"<= {target:.1f} {'ok' if r['bytes'] <= target else 'MISS'}"
    line = f"| {r['name']} | {r['bytes']:.3f} | {ok_bytes} |"
    if "mlp" in tasks:
        line += f" {r['step_ms']:.2f} | {r['step_ms'] / base['step_ms']:.2f}x |"
    for task in tasks:
        rel = r[task] / base[task] - 1
        verdict = "-" if r is base else ("yes" if abs(rel) <= TARGET_LOSS else "NO")
        if r["state_dtype"] == "fp32" and r is not base:
            verdict = f"({verdict}: noise)"
        line += f" {r[task]:.5f} | {100 * rel:+.2f}% | {verdict} |"
    return line


def results_table(rows: list[dict], tasks: list[str]) -> str:
    """The markdown table of every row against the first (fp32)."""
    head = "| state | bytes/param | target |"
    rule = "|---|---|---|"
    if "mlp" in tasks:
        head += " step ms (mlp) | vs fp32 |"
        rule += "---|---|"
    for task in tasks:
        head += f" {task} final loss | vs fp32 | within 2% |"
        rule += "---|---|---|"
    return "\n".join([head, rule, *(table_row(r, rows[0], tasks) for r in rows)])


def write_results(path: str, device: torch.device, setup: list[str], table: str) -> None:
    """The table with its setup in the MuonLP section of ``path`` (GPU and CPU runs keep
    their own sections: a CPU smoke run never replaces GPU numbers)."""
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    setup_md = "".join(f"- {line}\n" for line in setup)
    write_section(
        path,
        "bench_lp" if device.type == "cuda" else "bench_lp_cpu",
        f"## MuonLP state dtypes ({datetime.date.today().isoformat()})\n\n"
        f"- device: {device_name(device)}\n- torch: {torch.__version__}\n"
        f"- command: `{command}`\n{setup_md}"
        f"- fp32 = `MuonForeach` (fp32 momentum); `fp32 seed+1` (or `fp32 seeds N-..`) = "
        f"the same with other data seeds (run-to-run noise); step time is "
        f"`optimizer.step()` only (median); final loss on a held-out set\n\n{table}\n",
    )


def main() -> None:
    args = parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    apply_preset(args, device)
    logging.basicConfig(level=logging.WARNING)

    torch.manual_seed(0)
    teacher = Net(args.d_in, args.dim // 2, args.hidden // 2, 2, args.d_out).to(device)
    for p in teacher.parameters():
        p.requires_grad_(False)
    text = stdlib_text(args.lm_bytes) if "lm" in args.task_list else None

    setup = setup_lines(args, text)
    print(f"bench_lp: {device_name(device)}, torch {torch.__version__}", flush=True)
    for line in setup:
        print(f"  {line}")
    start = time.perf_counter()
    runs = {
        "mlp": lambda d, seed: run_mlp(d, teacher, args, device, seed),
        "lm": lambda d, seed: run_lm(d, text, args, device, seed),
    }
    rows = run_rows(args, runs)
    table = results_table(rows, args.task_list)
    elapsed = time.perf_counter() - start
    print()
    print(table)
    print(f"\n({elapsed:.0f} s)")
    if args.results:
        write_results(args.results, device, setup, table)


if __name__ == "__main__":
    main()
